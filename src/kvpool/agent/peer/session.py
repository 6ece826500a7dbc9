"""The two halves of a peer connection's handshake (:mod:`kvpool.common.handshake`).

Each returns the key id both sides agreed on (the one chunks are sealed with on
this connection) and the other side's node name, or raises: :class:`NotProven`
where the other side lacks the credential (or refused ours), :class:`WireError`
where it broke the protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.agent.l2.codec import AEGIS_FORMAT_VERSION
from kvpool.agent.peer.transport import PeerChannel
from kvpool.agent.peer.wire import (
    MAX_HANDSHAKE_BYTES,
    VERSION,
    Hello,
    Prove,
    Refused,
    Welcome,
    WireError,
)
from kvpool.common.handshake import (
    CLIENT,
    SERVER,
    NotProven,
    check,
    common_key,
    nonce,
    proof,
)
from kvpool.common.keyring import Keyring


@dataclass(frozen=True, slots=True)
class Session:
    node: str
    """The other side's node name."""
    key_id: int
    """The peer key chunks are sealed with on this connection."""
    opens_aegis: bool = False
    """A server's: the client opens objects sealed with AEGIS-128L (format 3)."""


def open_session(
    channel: PeerChannel,
    keyring: Keyring,
    pool: str,
    node: str,
    *,
    formats: Sequence[int] = (AEGIS_FORMAT_VERSION,),
) -> Session:
    """The client's half: prove, then check the server's proof. ``formats``: the object
    formats it opens besides format 2 (an agent opens all this build reads)."""
    hello, _ = channel.receive()
    if isinstance(hello, Refused):
        raise NotProven(f"the peer refused the connection: {hello.reason}")
    if not isinstance(hello, Hello):
        raise WireError(f"expected hello, got {type(hello).__name__}")
    keys = keyring.current()
    try:
        key_id = common_key(keys, hello.key_ids)
    except NotProven as error:
        channel.send(Refused(str(error)))
        raise
    ours = nonce()
    nonces, nodes = (hello.nonce, ours), (hello.node, node)
    channel.send(
        Prove(
            node,
            ours,
            key_id,
            proof(keys, key_id, pool=pool, role=CLIENT, nonces=nonces, nodes=nodes),
            list(formats),
        )
    )
    answer, _ = channel.receive()
    if isinstance(answer, Refused):
        raise NotProven(f"the peer refused this agent's proof: {answer.reason}")
    if not isinstance(answer, Welcome):
        raise WireError(f"expected welcome, got {type(answer).__name__}")
    check(proof(keys, key_id, pool=pool, role=SERVER, nonces=nonces, nodes=nodes), answer.proof)
    channel.proven(hello.node, hello.lands)
    return Session(hello.node, key_id)


def accept_session(channel: PeerChannel, keyring: Keyring, pool: str, node: str) -> Session:
    """The server's half: hello, check the client's proof, prove back (or refuse and raise).

    It reads at most :data:`~kvpool.agent.peer.wire.MAX_HANDSHAKE_BYTES` of the client's
    (its time the caller bounds: :meth:`~kvpool.agent.peer.transport.PeerChannel.set_deadline`).
    """
    keys = keyring.current()
    ours = nonce()
    channel.send(Hello(VERSION, node, ours, sorted(keys.by_id), lands=channel.lands))
    prove, _ = channel.receive(MAX_HANDSHAKE_BYTES)
    if isinstance(prove, Refused):
        raise NotProven(f"the peer refused the connection: {prove.reason}")
    if not isinstance(prove, Prove):
        raise WireError(f"expected prove, got {type(prove).__name__}")
    nonces, nodes = (ours, prove.nonce), (node, prove.node)
    try:
        check(
            proof(keys, prove.key_id, pool=pool, role=CLIENT, nonces=nonces, nodes=nodes),
            prove.proof,
        )
    except NotProven as error:
        channel.send(Refused(str(error)))
        raise
    channel.send(
        Welcome(proof(keys, prove.key_id, pool=pool, role=SERVER, nonces=nonces, nodes=nodes))
    )
    channel.proven(prove.node, False)
    return Session(prove.node, prove.key_id, AEGIS_FORMAT_VERSION in prove.formats)
