"""The ZMQ protocol between vLLM (the connector) and the node agent.

Transport: ZMTP 3 over TCP; clients connect DEALER sockets, the agent plays the ROUTER's
part (:mod:`kvpool.agent.edge.zmtp`, which bounds a message's frames and bytes).
Every message is one msgpack frame holding a tagged array (``[op, req, ...]``,
decoded with msgspec), followed by raw data frames for the inline operations
only. ``req`` is chosen by the client and echoed in the reply, so a client can
drop stale replies after a timeout.

Zero-copy path (clients that map chunk files)::

    hello ─► lookup (read-locks the hit prefix) ─► client copies out ─► release
          └► prepare_store (write-locks) ─► client copies in ─► commit_store

A lookup's and a prepare_store's offsets lie in one chunk file, its account's, which the
reply names by id (``file``); a client gets a descriptor of it from the agent's door
(:mod:`kvpool.common.door`, at the hello's ``door_path``) and maps it. A tenant's token
stores into a shared space inline only (its door gives it the space's file read-only).

Push (a disaggregated prefill's connector, once its prompt's chunks are committed):
``push`` asks the agent to offer them to the agent of the decode's node, which pulls
them (:mod:`kvpool.agent.peer.offers`); an agent that predates it answers ``unknown_op``.

Inline path (clients that map nothing): ``store_inline`` carries one data
frame per key; ``retrieve_inline`` answers with one data frame per hit.

Every failure is an :class:`Error` reply with a stable ``code``; the agent goes
on serving everyone else. Clients must send ``hello`` first; a
different version gets ``unsupported_version``.

Credentials: ``hello`` carries a bearer token (an admin's, an engine's, an index's or a
KVCacheTenant's); without a valid one it is refused with ``unauthenticated``, and every
other request needs the session that a hello opened. What a session may do depends on its
token's role (:mod:`kvpool.agent.edge.zmq_server`); a request beyond it gets ``forbidden``.
The events feed (:data:`EVENTS_TOPIC`) takes the same token as a ZMQ PLAIN password.
"""

from __future__ import annotations

import enum

import msgspec

PROTOCOL_VERSION = 2
"""2: chunks live in chunk files, named by id in replies and handed out by the door."""
NO_LEASE = 0
"""``lease`` in a reply when nothing was locked."""


class ErrorCode(enum.StrEnum):
    MALFORMED = "malformed"
    UNKNOWN_OP = "unknown_op"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNAUTHENTICATED = "unauthenticated"
    """hello without a known token, or a session whose token was revoked since."""
    FORBIDDEN = "forbidden"
    """The session's token may not do this (another tenant's chunks, snapshot, clear...)."""
    UNKNOWN_SESSION = "unknown_session"
    """No such session on this connection (the agent restarted, or it is another's): hello."""
    SESSION_FENCED = "session_fenced"
    """A write lease of this session expired before its commit, so its writes may have come
    late: the session and all its leases are void. Say hello for a new session."""
    UNKNOWN_LEASE = "unknown_lease"
    LEASE_EXPIRED = "lease_expired"
    """The store lease expired before this commit: nothing was published. Its pages stay
    quarantined (never reused) until the session ends, so late writes harm no one."""
    NOT_YOUR_LEASE = "not_your_lease"
    INVALID_REQUEST = "invalid_request"
    TOO_LARGE = "too_large"
    INTERNAL = "internal"


class _Message(msgspec.Struct, array_like=True, tag_field="op"):
    req: int


# ----------------------------------------------------------------- requests


class Hello(_Message, tag="hello"):
    version: int
    client: str
    token: str = ""
    """The caller's bearer token; never logged."""


class Ping(_Message, tag="ping"):
    session: int = 0


class Lookup(_Message, tag="lookup"):
    """Prefix lookup; with ``lock`` (prepare_retrieve) the hits stay read-locked under a lease.

    With ``prefetch``, the agent starts loading the keys after the hits from L2
    into L1 and names the prefetch in the reply; ``prefetch_status`` follows it.
    """

    session: int
    tenant: str
    keys: list[bytes]
    lock: bool = True
    prefetch: bool = False
    parent: bytes | None = None
    """The key before ``keys[0]``, when the lookup starts mid-chain."""
    count: bool = True
    """Count the hits and misses (tenant statistics, write-back reuse). A client that looks
    the same chunks up again (vLLM's scheduler probes, then its worker loads) counts once."""


class PrepareStore(_Message, tag="prepare_store"):
    session: int
    tenant: str
    keys: list[bytes]
    sizes: list[int]
    parent: bytes | None = None


class CommitStore(_Message, tag="commit_store"):
    """Publish the first ``count`` (default all) chunks of a store lease; discard the rest."""

    session: int
    lease: int
    count: int | None = None


class Release(_Message, tag="release"):
    """End a lease: commit_retrieve for a read lease, cancel for a store lease."""

    session: int
    lease: int


class StoreInline(_Message, tag="store_inline"):
    """Followed by one data frame per key."""

    session: int
    tenant: str
    keys: list[bytes]
    parent: bytes | None = None


class RetrieveInline(_Message, tag="retrieve_inline"):
    session: int
    tenant: str
    keys: list[bytes]


class EndSession(_Message, tag="end_session"):
    session: int


class Clear(_Message, tag="clear"):
    """Drop one tenant's chunks, or every chunk when ``tenant`` is None."""

    session: int
    tenant: str | None = None


class Stats(_Message, tag="stats"):
    session: int = 0


class Snapshot(_Message, tag="snapshot"):
    """Every ready key by tenant, for a prefix index resynchronising with the chunk events."""

    session: int
    tiers: list[str] = []
    """Lower tiers whose keys the reply should carry too ("nvme"); an agent that predates
    the field ignores it and answers L1 only, as it does for a request without it."""


class PrefetchStatus(_Message, tag="prefetch_status"):
    """How far a prefetch got; with ``wait_ms``, the reply waits until it is done (or the time)."""

    session: int
    prefetch: int
    wait_ms: int = 0


class Push(_Message, tag="push"):
    """Offer ``keys`` (``tenant``'s, committed here; ``parent`` before them) to the agent of
    ``node``, which pulls those it lacks. Best effort: the reply says whether it was sent."""

    session: int
    tenant: str
    keys: list[bytes]
    node: str
    parent: bytes | None = None


Request = (
    Hello
    | Ping
    | Lookup
    | PrepareStore
    | CommitStore
    | Release
    | StoreInline
    | RetrieveInline
    | EndSession
    | Clear
    | Stats
    | PrefetchStatus
    | Snapshot
    | Push
)
REQUEST_TYPES: tuple[type[_Message], ...] = (
    Hello,
    Ping,
    Lookup,
    PrepareStore,
    CommitStore,
    Release,
    StoreInline,
    RetrieveInline,
    EndSession,
    Clear,
    Stats,
    PrefetchStatus,
    Snapshot,
    Push,
)


def op_name(message: _Message) -> str:
    """The wire tag of a message, e.g. ``"lookup"``."""
    return str(message.__struct_config__.tag)


REQUEST_OPS = frozenset(str(kind.__struct_config__.tag) for kind in REQUEST_TYPES)

# ------------------------------------------------------------------ replies


class HelloReply(_Message, tag="hello_reply"):
    version: int
    session: int
    """64 random bits, valid only on the connection that said hello."""
    agent_id: str
    """Changes when the agent restarts: a client's session is then gone."""
    segment_path: str
    data_offset: int
    data_size: int
    page_size: int
    max_inline_bytes: int
    max_keys: int
    tenant: str = ""
    """The tenant a KVCacheTenant's token acts for (its requests' default tenant); "" for
    the other roles."""
    segment_device: int = 0
    segment_inode: int = 0
    """The agent's segment (device and inode numbers): they change when an agent starts
    from empty, with new chunk files (a client drops the descriptors it holds)."""
    door_path: str = ""
    """Where the agent's door listens, as the agent sees it (a pod's may differ)."""


class Pong(_Message, tag="pong"):
    agent_id: str


class LookupReply(_Message, tag="lookup_reply"):
    lease: int
    offsets: list[int]
    sizes: list[int]
    prefetch: int = 0
    """Id of the prefetch started for the keys after the hits; 0 when none was started."""
    file: int = 0
    """The chunk file the hits are in (0: no hit)."""


class PrefetchStatusReply(_Message, tag="prefetch_status_reply"):
    done: bool
    expected: int
    """Chunks after the L1 hits that L2 holds and that are being loaded; -1 while unknown."""
    loaded: int
    """Of those, chunks now ready in L1 (a lookup of the same keys will hit them)."""


class PrepareStoreReply(_Message, tag="prepare_store_reply"):
    """``offsets[i]``: where to write ``keys[i]``, -1 if already cached; refusal covers the tail."""

    lease: int
    offsets: list[int]
    refused: str | None = None
    file: int = 0
    """The chunk file the offsets are in (0: nothing reserved)."""


class CommitReply(_Message, tag="commit_reply"):
    committed: int


class Ok(_Message, tag="ok"):
    pass


class StoreInlineReply(_Message, tag="store_inline_reply"):
    stored: int
    present: int
    refused: str | None = None


class RetrieveInlineReply(_Message, tag="retrieve_inline_reply"):
    """Followed by ``count`` data frames, the hits in order."""

    count: int


class ClearReply(_Message, tag="clear_reply"):
    cleared: int


class StatsReply(_Message, tag="stats_reply"):
    stats: dict[str, int | float]


class SnapshotReply(_Message, tag="snapshot_reply"):
    agent: str
    seq: int
    """The last chunk event this snapshot includes; apply only later events to it."""
    tenants: dict[str, list[bytes]]
    """L1's keys by tenant."""
    tiers: dict[str, dict[str, list[bytes]]] = {}
    """Of the tiers the request named, those whose every key this agent knows: their keys by
    tenant, as of ``seq`` or a little later (replaying the events after ``seq`` on them is
    harmless). A tier named but absent is one the agent does not list: "s3" (its events are
    all there is), or any tier for an agent that predates the field."""


class PushReply(_Message, tag="push_reply"):
    unsent: str | None = None
    """Why the offer was not sent (no peers, an unknown node, this agent's own); None: it
    is on its way (the receiver may still be busy: the decode's lookup pulls then)."""


class Error(_Message, tag="error"):
    code: str
    message: str


Reply = (
    HelloReply
    | Pong
    | LookupReply
    | PrefetchStatusReply
    | PrepareStoreReply
    | CommitReply
    | Ok
    | StoreInlineReply
    | RetrieveInlineReply
    | ClearReply
    | StatsReply
    | SnapshotReply
    | PushReply
    | Error
)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_any_decoder = msgspec.msgpack.Decoder()


class ProtocolError(ValueError):
    """A frame that is not a valid message; ``code`` and ``req`` go into the error reply."""

    def __init__(self, code: ErrorCode, message: str, req: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.req = req


def encode(message: _Message) -> bytes:
    return _encoder.encode(message)


_UNDECODABLE = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)
"""What decoding a frame raises when the frame is bad. RecursionError: msgpack nested
deeper than the decoder's stack (``b"\x91" * 5000 + b"\xc0"``), which no message is."""
_TOO_DEEP = "frame is msgpack nested too deeply"


def decode_request(frame: bytes | memoryview) -> Request:
    try:
        request: Request = _request_decoder.decode(frame)  # typed by msgspec 0.23 on
    except _UNDECODABLE as error:
        raise _classify(frame, error) from None
    return request


def decode_reply(frame: bytes | memoryview) -> Reply:
    try:
        reply: Reply = _reply_decoder.decode(frame)
    except _UNDECODABLE as error:
        reason = _TOO_DEEP if isinstance(error, RecursionError) else error
        raise ProtocolError(ErrorCode.MALFORMED, f"malformed reply: {reason}") from None
    return reply


def _classify(frame: bytes | memoryview, error: Exception) -> ProtocolError:
    """Why a request did not decode; done only on failure, so the hot path decodes once."""
    try:
        raw = _any_decoder.decode(frame)
    except RecursionError:
        return ProtocolError(ErrorCode.MALFORMED, _TOO_DEEP)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return ProtocolError(ErrorCode.MALFORMED, "frame is not valid msgpack")
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        return ProtocolError(ErrorCode.MALFORMED, "a request is an array [op, req, ...]")
    req = raw[1] if len(raw) > 1 and type(raw[1]) is int and raw[1] >= 0 else 0
    if raw[0] not in REQUEST_OPS:
        known = ", ".join(sorted(REQUEST_OPS))
        return ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {raw[0]!r}; known: {known}", req)
    reason = _TOO_DEEP if isinstance(error, RecursionError) else error
    return ProtocolError(ErrorCode.MALFORMED, f"bad {raw[0]} request: {reason}", req)


_ARRAY_HEADER = {0xDC: 3, 0xDD: 5} | {fixarray: 1 for fixarray in range(0x90, 0xA0)}
"""The size of a msgpack array's header, by its first byte."""
_UINT_SIZE = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


def peek_request(start: bytes) -> tuple[str, int] | None:
    """The op and req of a request of which only ``start`` is known (the agent holds no
    more than a few KiB of a message sent before hello); None if it starts as none does."""
    try:
        position = _ARRAY_HEADER[start[0]]
        tag = start[position]
        if 0xA0 <= tag <= 0xBF:
            size, position = tag & 0x1F, position + 1
        elif tag == 0xD9:
            size, position = start[position + 1], position + 2
        else:
            return None
        op, position = start[position : position + size], position + size
        kind = start[position]
        width = 0 if kind <= 0x7F else _UINT_SIZE[kind]
        number = start[position + 1 : position + 1 + width]
    except (IndexError, KeyError):
        return None
    if len(op) != size or len(number) != width:
        return None
    return op.decode(errors="replace"), int.from_bytes(number, "big") if width else kind


# ---------------------------------------------------------------- the events feed
# The agent's events port (a ZMQ PUB socket, :mod:`kvpool.agent.edge.events`) publishes
# what enters and leaves its cache; the prefix index subscribes. Each message is two
# frames, the topic :data:`EVENTS_TOPIC` and one msgpack :class:`ChunkEvent`.

EVENTS_TOPIC = b"kvpool.chunks"

TIER_L1 = "l1"
"""The agent's shared-memory segment: what it serves at once."""
TIER_NVME = "nvme"
"""The agent's NVMe files: what it loads into L1 from its own disk."""
TIER_S3 = "s3"
"""The pool's bucket, written back by this agent: what any agent of the pool can load."""
TIERS = (TIER_L1, TIER_NVME, TIER_S3)


class ChunkEvent(msgspec.Struct, array_like=True, frozen=True):
    seq: int
    agent: str
    kind: str
    """"stored" or "removed"."""
    tier: str
    """"l1", "nvme" or "s3"; one sequence covers every tier of an agent, so a
    subscriber skips a tier it does not follow but counts its events in ``seq``."""
    tenant: str
    keys: list[bytes]
    cause: str = ""
    """For removals: watermark, pressure, quota or cleared (L1); pressure, quota, deleted,
    corrupt, missing or failed (NVMe); deleted (S3)."""
    time: float = 0.0
    """Unix time the agent published the event (0: unknown)."""


_event_decoder = msgspec.msgpack.Decoder(ChunkEvent)


def decode_event(frame: bytes) -> ChunkEvent:
    return _event_decoder.decode(frame)


def encode_event(event: ChunkEvent) -> bytes:
    return msgspec.msgpack.encode(event)
