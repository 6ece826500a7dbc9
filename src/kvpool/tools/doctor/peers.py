"""The peers check: this node's agent reaches the pool's other agents.

Asks the agent to connect to every peer now (``GET /v1/peers?probe=true``, admin token):
a fresh connection and handshake each, both sides proving the pool's peer credential. A
peer it cannot reach is not a failure of this node (its chunks come from S3 or are
recomputed), so it is a WARN naming each such peer and why. An agent without peers (404:
its pool has ``spec.peers.enabled: false``) is skipped, saying so.
"""

from __future__ import annotations

from kvpool.common.api_models import Peers, PeerState
from kvpool.tools.doctor.agent_http import admin_get
from kvpool.tools.doctor.report import Check, passed, skipped, warned

NAME = "peers"
PROBE_SECONDS = 60.0
"""At least this long for the answer: the agent probes its peers one after another, each
bounded by its connect and I/O timeouts (peers.connect_timeout_seconds,
peers.io_timeout_seconds)."""
OFF = (
    "this agent has no peer tier (no peers section: the pool has spec.peers.enabled: false); "
    "it neither serves nor pulls peer chunks"
)
UNREACHABLE_FIX = (
    "until then this node misses the chunks only they hold (S3 or a recompute serves them): "
    "is each one's agent running, does a NetworkPolicy let the agents reach each other on "
    "the peer port (spec.peers.port), and do both mount the pool's peer Secret "
    "kvpool-<pool>-peer (a rotated key reaches every agent within about a minute and a half)?"
)

WIRE = {
    "sealed": "chunks sent sealed",
    "integrity": "chunks sent as plaintext under their tag: spec.peers.wireProtection integrity",
}


def check_peers(http_url: str | None, token: str | None, timeout: float) -> Check:
    peers = admin_get(
        NAME,
        "/v1/peers?probe=true",
        Peers,
        http_url=http_url,
        token=token,
        timeout=max(timeout, PROBE_SECONDS),
        absent=skipped(NAME, OFF),
    )
    if isinstance(peers, Check):
        return peers
    serving = peers.serving
    me = f"{peers.node} (peer port {peers.port}, {WIRE[serving.wire_protection]}, {_moved(peers)})"
    if not peers.peers:
        return passed(
            NAME,
            f"{me} knows no other agent of its pool: nothing to reach (a pool of one node; "
            "with more, its discovery finds none: see the agent's log)",
        )
    unreachable = [peer for peer in peers.peers if not peer.reachable]
    if unreachable:
        reached = len(peers.peers) - len(unreachable)
        return warned(
            NAME,
            f"{me} reaches {reached} of its {_peers(len(peers.peers))}; "
            + "; ".join(f"{_where(peer)}: {peer.error or 'not reached'}" for peer in unreachable),
            UNREACHABLE_FIX,
        )
    rtts = ", ".join(
        f"{_where(peer)} ({peer.rtt_ms or 0:.1f} ms, {peer.transport or 'not connected'})"
        for peer in peers.peers
    )
    return passed(NAME, f"{me} reaches its {_peers(len(peers.peers))}, credential proven: {rtts}")


def _moved(peers: Peers) -> str:
    """What carries its chunk bodies, and why not NIXL where it was asked for."""
    serving = peers.serving
    if serving.transport_fallback:
        return f"bodies over tcp: {serving.transport_fallback}"
    return f"bodies over {serving.transport}"


def _where(peer: PeerState) -> str:
    return f"{peer.node} at {peer.endpoint}"


def _peers(count: int) -> str:
    return f"{count} peer" if count == 1 else f"{count} peers"
