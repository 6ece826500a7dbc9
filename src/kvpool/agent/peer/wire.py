"""The peer protocol: framed messages between the agents of one pool.

Every frame is a fixed header, then ``meta_length`` bytes of msgpack (one of the
messages below), then ``body_length`` raw bytes (a sealed chunk, after
:class:`Object` only)::

    magic "KVPP" | version u8 | reserved u8[3] | meta length u32 | body length u64

A connection begins with the handshake (:mod:`kvpool.common.handshake`): the
server speaks first (:class:`Hello`), the client proves the pool's peer
credential (:class:`Prove`), the server proves it back (:class:`Welcome`) or
refuses (:class:`Refused`) and closes. Then the client asks, one request at a
time, each answered in order: :class:`Exists` with :class:`Have`; :class:`Get`
with :class:`Object` (whose body is the chunk sealed by
:class:`~kvpool.agent.l2.codec.ObjectCodec` under the peer key the handshake
agreed on), :class:`Missing` or :class:`Busy`; :class:`Offer` (the asking agent
holds a tenant's prefix that a request on the server's node is about to want: a
disaggregated prefill's) with :class:`Accepted` (the server pulls it, as it would
for a lookup of its own) or :class:`Busy`. On the NIXL transport
(:mod:`kvpool.agent.peer.transport_nixl`) a client whose server's hello says it lands
sends :class:`Landing` once proven, and the server answers a :class:`Get` with
:class:`Written` instead of :class:`Object`: the body went through the transfer engine
into the landing, and only the control frames cross this connection. An agent that
predates offers closes the connection on one: the offer is lost, and the pull is the
fallback. A frame that is malformed, too large or unexpected ends the connection:
:class:`WireError`. Between requests a
connection may sit idle for :data:`IDLE_SECONDS`.
"""

from __future__ import annotations

import struct

import msgspec

from kvpool.common.handshake import NONCE_BYTES

MAGIC = b"KVPP"
VERSION = 1
FRAME = struct.Struct("<4sB3xIQ")
MAX_META_BYTES = 1 << 20
"""An :class:`Exists` of a few thousand keys fits; a peer claiming more is cut off."""
MAX_HANDSHAKE_BYTES = 4096
"""A :class:`Prove` fits (a node name is at most 253 characters): before a connection has
proven the pool's credential, the server reads no larger message."""
MAX_KEYS = 8192
IDLE_SECONDS = 120.0
"""How long a server waits for a connection's next request before it closes it (inside a
frame, the I/O timeout applies); a client reuses a kept connection for half as long."""
KEY_BYTES = 32


class WireError(ValueError):
    """The peer broke the protocol (or the connection ended mid-frame): close it."""


class PeerClosed(ConnectionError):
    """The other side closed the connection between two frames: the end of its requests
    (a client that stopped, or dropped a kept connection), not a broken protocol."""


class Hello(msgspec.Struct, tag="hello", frozen=True):
    version: int
    node: str
    nonce: bytes
    key_ids: list[int]
    """The peer key ids the server holds: the client proves with the highest it holds too."""
    lands: bool = False
    """The server writes a chunk's body into the client's landing through the transfer
    engine (NIXL) once the client sends one (:class:`Landing`)."""


class Prove(msgspec.Struct, tag="prove", frozen=True):
    node: str
    nonce: bytes
    key_id: int
    proof: bytes
    formats: list[int] = msgspec.field(default_factory=list)
    """The object formats the client opens besides format 2 (AES-GCM), which every agent
    opens: a server seals in the newest of them it writes (an older client sends none)."""


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    proof: bytes


class Refused(msgspec.Struct, tag="refused", frozen=True):
    reason: str


class Exists(msgspec.Struct, tag="exists", frozen=True):
    tenant: str
    keys: list[bytes]


class Have(msgspec.Struct, tag="have", frozen=True):
    count: int
    """How many of the asked keys, from the first, the server holds (L1 or NVMe)."""


class Get(msgspec.Struct, tag="get", frozen=True):
    tenant: str
    key: bytes


class Object(msgspec.Struct, tag="object", frozen=True):
    """The body that follows is the chunk, sealed for the tenant the :class:`Get` named."""


class Missing(msgspec.Struct, tag="missing", frozen=True):
    """Not held (any more) under that tenant."""


class Busy(msgspec.Struct, tag="busy", frozen=True):
    """Too many transfers in flight: try another tier."""


class Offer(msgspec.Struct, tag="offer", frozen=True):
    """The asking agent holds ``keys`` (a prefix of ``tenant``'s, ``parent`` before it)."""

    tenant: str
    keys: list[bytes]
    parent: bytes | None = None


class Accepted(msgspec.Struct, tag="accepted", frozen=True):
    """The server is pulling the offered chunks (those it lacks) into its L1."""


class Landing(msgspec.Struct, tag="landing", frozen=True):
    """Where the server writes the bodies of this connection's chunks from now on: ``length``
    bytes at ``address`` in the client's transfer-engine agent ``agent``, whose metadata
    (connection and the landing's registration, nothing else) is ``metadata``, in ``slots``
    equal slots: the n-th body written goes into slot n modulo ``slots`` (the client has at
    most that many requests in flight). Sent only after the handshake, with no request in
    flight, to a server whose hello said it lands; never answered."""

    agent: str
    metadata: bytes
    address: int
    length: int
    slots: int = 1


class Written(msgspec.Struct, tag="written", frozen=True):
    """An :class:`Object` whose ``length`` bytes of body the server wrote into the
    connection's landing before sending this, at ``offset`` (the start of the next slot, or
    right after the body said before it, in that body's slot; no body follows on the
    connection)."""

    length: int
    offset: int = 0


Message = (
    Hello
    | Prove
    | Welcome
    | Refused
    | Exists
    | Have
    | Get
    | Object
    | Missing
    | Busy
    | Offer
    | Accepted
    | Landing
    | Written
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def frame(message: Message, body_length: int = 0) -> bytes:
    """The header and the encoded ``message`` (its body is sent after, by the caller)."""
    meta = _encoder.encode(message)
    return FRAME.pack(MAGIC, VERSION, len(meta), body_length) + meta


def parse_header(
    header: bytes | bytearray | memoryview, max_meta_bytes: int = MAX_META_BYTES
) -> tuple[int, int]:
    """``(meta length, body length)`` of a frame header; :class:`WireError` if it is not one
    (or its message is over ``max_meta_bytes``)."""
    magic, version, meta_length, body_length = FRAME.unpack(header)
    if magic != MAGIC:
        raise WireError("not a kvpool peer frame")
    if version != VERSION:
        raise WireError(f"peer protocol version {version}; this agent speaks {VERSION}")
    if meta_length > max_meta_bytes:
        raise WireError(f"a message of {meta_length} bytes (at most {max_meta_bytes})")
    return meta_length, body_length


def parse_message(meta: bytes | bytearray | memoryview) -> Message:
    try:
        message: Message = _decoder.decode(meta)
    except msgspec.DecodeError as error:
        raise WireError(f"malformed message: {error}") from None
    _check(message)
    return message


def _check(message: Message) -> None:
    keys: list[bytes] = []
    if isinstance(message, Exists | Offer):
        if len(message.keys) > MAX_KEYS:
            raise WireError(f"{len(message.keys)} keys in one request (at most {MAX_KEYS})")
        keys = message.keys
        if isinstance(message, Offer) and message.parent is not None:
            keys = [*keys, message.parent]
    elif isinstance(message, Get):
        keys = [message.key]
    if any(len(key) != KEY_BYTES for key in keys):
        raise WireError(f"a chunk key that is not {KEY_BYTES} bytes")
    if isinstance(message, Hello | Prove) and len(message.nonce) != NONCE_BYTES:
        raise WireError(f"a nonce that is not {NONCE_BYTES} bytes")
