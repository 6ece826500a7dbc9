"""Chunk events: what enters and leaves this agent's cache, on a ZMQ PUB socket.

A pool-wide prefix index (``kvpool-index``) subscribes to every agent. Each
message is two frames, the topic :data:`~kvpool.common.protocol.EVENTS_TOPIC` and a msgpack
:class:`~kvpool.common.protocol.ChunkEvent`. ``seq`` grows by one per message of one agent process
(``agent`` changes when the agent restarts), so a subscriber sees every gap;
after a gap it asks the agent for a ``snapshot`` (ZMQ request) of the keys it
holds, which carries the ``seq`` it is consistent with. PUB never blocks the
cache: a subscriber that falls behind loses messages and resynchronises.
A subscriber connects with ZMQ's PLAIN mechanism, its password an index's (or an admin's)
token of the pool (:mod:`kvpool.agent.edge.zap`); any other connection is closed during
its handshake and receives nothing. Before its credentials are checked a connection may
send messages of :data:`MAX_SUBSCRIBER_MESSAGE` bytes at most (libzmq would otherwise take a
PLAIN HELLO of any announced size, and hold what came of it) and is closed unless its
handshake is over ``handshake_seconds`` after it opened (libzmq's default is 30 s).
libzmq has no bound on a socket's connections: each one still handshaking holds some
tens of KiB of libzmq's buffers until then.
One sequence covers every tier of the agent: L1's events (the cache's listener), and
those of its NVMe files and of its write-backs to S3 (:meth:`EventPublisher.tier`, the L2
adapters' listeners), each tagged with its ``tier``; a subscriber that follows L1 only
skips the others and still sees every gap. Tier events say no more than L1's did: keys and
tenant ids, never a salt or a byte of a chunk.
``time`` is the publisher's Unix time, so a subscriber can measure its lag (as
well as the nodes' clocks agree); it is the last field, so decoders that predate
it ignore it and events that predate it decode with 0.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import zmq

from kvpool.agent.edge.zap import PlainAuthenticator
from kvpool.common.auth import Role, TokenAuthority
from kvpool.common.protocol import EVENTS_TOPIC, TIER_L1, ChunkEvent, encode_event

log = logging.getLogger(__name__)

MAX_SUBSCRIBER_MESSAGE = 4 << 10
"""The largest message a subscriber sends: its PLAIN HELLO (a name and a token of at most
255 bytes each) and its subscriptions (the topic)."""


class EventPublisher:
    """A :class:`~kvpool.agent.core.cache_types.ChunkListener` that publishes every change."""

    def __init__(
        self,
        endpoint: str,
        agent_id: str,
        authority: TokenAuthority,
        tier: str = TIER_L1,
        handshake_seconds: float = 5.0,
    ) -> None:
        self.agent_id = agent_id
        self._authenticator = PlainAuthenticator(
            authority, (Role.INDEX, Role.ADMIN), domain="kvpool-events"
        )
        self._endpoint = endpoint
        self._tier = tier
        self._handshake_seconds = handshake_seconds
        self._lock = threading.Lock()  # L1 calls back from the ZMQ thread and the event loop
        self._socket: zmq.Socket[bytes] | None = None
        self._seq = 0
        self.bound_endpoint = ""

    def start(self) -> None:
        """Bind and publish; ``OSError`` (one line) if the endpoint cannot be bound."""
        self._authenticator.start()
        socket: zmq.Socket[bytes] = self._authenticator.context.socket(zmq.PUB)
        self._authenticator.protect(socket)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 100_000)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIBER_MESSAGE)
        socket.setsockopt(zmq.HANDSHAKE_IVL, round(self._handshake_seconds * 1000))
        try:
            socket.bind(self._endpoint)
        except zmq.ZMQError as error:
            socket.close()
            self._authenticator.stop()
            raise OSError(error.errno, error.strerror) from None
        self.bound_endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._socket = socket
        log.info("chunk events on %s", self.bound_endpoint)

    def stop(self) -> None:
        with self._lock:
            if self._socket is not None:
                self._socket.close()
                self._socket = None
        self._authenticator.stop()

    @property
    def seq(self) -> int:
        """The sequence number of the last message sent."""
        return self._seq

    def stored(self, tenant: str, keys: list[bytes]) -> None:
        self.publish(self._tier, "stored", tenant, keys, "")

    def removed(self, tenant: str, keys: list[bytes], cause: str) -> None:
        self.publish(self._tier, "removed", tenant, keys, cause)

    def tier(self, tier: str) -> TierEvents:
        """A listener whose events are ``tier``'s, in this publisher's sequence."""
        return TierEvents(self, tier)

    def publish(self, tier: str, kind: str, tenant: str, keys: list[bytes], cause: str) -> None:
        """Send one event now, or drop it (past the high-water mark, or stopped): never waits."""
        with self._lock:
            if self._socket is None:
                return
            self._seq += 1
            event = ChunkEvent(
                self._seq, self.agent_id, kind, tier, tenant, keys, cause, time.time()
            )
            # Past the high-water mark the message is dropped: subscribers see the gap and resync.
            with contextlib.suppress(zmq.Again):
                self._socket.send_multipart([EVENTS_TOPIC, encode_event(event)], zmq.NOBLOCK)


class TierEvents:
    """A :class:`~kvpool.agent.core.cache_types.ChunkListener` for one lower tier (NVMe,
    S3): its changes go out in its publisher's sequence, tagged with the tier.

    Called from the event loop (the adapters' bookkeeping): each call is one encode and a
    non-blocking send under the publisher's lock, which L1's callers hold as briefly.
    """

    def __init__(self, publisher: EventPublisher, tier: str) -> None:
        self._publisher = publisher
        self.tier = tier

    def stored(self, tenant: str, keys: list[bytes]) -> None:
        self._publisher.publish(self.tier, "stored", tenant, keys, "")

    def removed(self, tenant: str, keys: list[bytes], cause: str) -> None:
        self._publisher.publish(self.tier, "removed", tenant, keys, cause)
