"""Offers: this agent tells a peer that it holds a prefix a request on the peer's node is
about to want (a disaggregated prefill's, for its decode), and the peer pulls it.

The connector of a prefill asks for it once the prompt's chunks are committed (the ZMQ
``push`` operation); the offer goes to the decode's node over the peer protocol
(:meth:`~kvpool.agent.peer.links.PeerLink.offer`), and that agent pulls the chunks it
lacks as it would for a lookup of its own (:class:`~kvpool.agent.peer.serving.PeerServer`):
the receiver decides what lands, within the tenant's quota there. Sending never blocks the
caller: the offers run on a few threads of their own, at most :data:`MAX_IN_FLIGHT` at once
and half of those for one tenant; one past either is dropped (counted), and the decode's
own lookup pulls instead, as it does when an offer fails or the peer is busy.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvpool.agent.peer.directory import PeerDirectory
from kvpool.agent.peer.links import PeerLink, failure_reason
from kvpool.common.web.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)
_failures = RateLimitedLog(log)

MAX_IN_FLIGHT = 16
"""Offers being sent at once (each a round trip: the receiver answers before it pulls)."""
THREADS = 4


@dataclass
class OfferStats:
    sent: Counter[str] = field(default_factory=Counter)
    """Offers by outcome: accepted, busy (the peer had no slot), failed (unreachable,
    refused, an older agent), dropped (too many in flight here), unknown (no such peer)."""


class Offers:
    def __init__(self, directory: PeerDirectory) -> None:
        self.directory = directory
        self.stats = OfferStats()
        self._lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()
        self._threads = ThreadPoolExecutor(THREADS, thread_name_prefix="kvpool-peer-offer")

    def offer(self, node: str, tenant: str, keys: list[bytes], parent: bytes | None) -> str | None:
        """Offer ``keys`` of ``tenant``'s (``parent`` before them) to the agent of ``node``,
        in the background; why it is not sent, or None."""
        if node == self.directory.settings.node:
            return "the decode runs on this agent's node: nothing to send"
        link = self._link(node)
        if link is None:
            self._count("unknown")
            return f"no peer on node {node[:64]!r}"
        with self._lock:
            total = sum(self._in_flight.values())
            if total >= MAX_IN_FLIGHT or self._in_flight[tenant] >= MAX_IN_FLIGHT // 2:
                self.stats.sent["dropped"] += 1
                return "too many offers in flight"
            self._in_flight[tenant] += 1
        self._threads.submit(self._send, link, tenant, keys, parent)
        return None

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _send(self, link: PeerLink, tenant: str, keys: list[bytes], parent: bytes | None) -> None:
        try:
            outcome = "accepted" if link.offer(tenant, keys, parent) else "busy"
        except Exception as error:  # the link counted it; the pull is the fallback
            outcome = "failed"
            reason = failure_reason(error) or type(error).__name__
            _failures.warning(f"an offer to peer {link.node} failed ({reason})")
        finally:
            with self._lock:
                self._in_flight[tenant] -= 1
                if not self._in_flight[tenant]:
                    del self._in_flight[tenant]
        self._count(outcome)

    def _link(self, node: str) -> PeerLink | None:
        return next((link for link in self.directory.links() if link.node == node), None)

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.stats.sent[outcome] += 1
