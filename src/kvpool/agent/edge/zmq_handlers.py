"""The ZMQ edge's request handlers: each checks the session, decodes a request, calls one
operation of the cache service and encodes the reply (see :mod:`kvpool.agent.edge.zmq_server`
for the port, the serving loop and what each token may do).

A handler raises :class:`~kvpool.common.protocol.ProtocolError` (or the cache's domain
errors) for anything it refuses; the server turns every error into an
:class:`~kvpool.common.protocol.Error` reply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.agent.core.cache_types import InvalidRequest
from kvpool.agent.edge.zmq_sessions import Peer, SessionTable, check_tenant
from kvpool.agent.edge.zmtp import Frame
from kvpool.agent.service.cache_service import CacheService
from kvpool.common import protocol as p
from kvpool.common.auth import Role, TokenAuthority
from kvpool.common.keys import CANARY_TENANT, KEY_BYTES
from kvpool.common.segment import SharedSegment, door_path
from kvpool.common.tenants_configmap import digest_token

Frames = Sequence[Frame]
Handled = tuple[p.Reply, list[bytes]] | None
"""A reply and its data frames, or None when there is none to send now: the reply is
parked for later, or the connection is closed."""
Handler = Callable[[p.Request, Frames, Peer], Handled]
Offer = Callable[[str, str, list[bytes], bytes | None], str | None]
"""Offer a tenant's chunks to a node's agent (node, tenant, keys, parent): why it was not
sent, or None."""
SHUTTING_DOWN = "the agent is shutting down"


class ZmqHandlers:
    def __init__(
        self,
        service: CacheService,
        sessions: SessionTable,
        segment: SharedSegment,
        *,
        authority: TokenAuthority,
        agent_id: str,
        max_inline_bytes: int,
        max_keys: int,
        admit: Callable[[Peer], bool],
        draining: Callable[[], bool],
        offer: Offer | None = None,
    ) -> None:
        """``admit``: whether the connection of a hello may stay (False: it was closed);
        ``draining``: whether new stores are refused; ``offer``: the peer tier's offers
        (None: this agent has no peers)."""
        self._service = service
        self._sessions = sessions
        self._segment = segment
        self._authority = authority
        self.agent_id = agent_id
        self._max_inline = max_inline_bytes
        self._max_keys = max_keys
        self._admit = admit
        self._draining = draining
        self._offer = offer

    def by_request(self) -> dict[type, Handler]:
        """The handler of each request type (but ``prefetch_status``, which the server
        parks, and ``snapshot``, which it lists on a thread of its own:
        :meth:`check_snapshot`, :meth:`snapshot_reply`)."""
        return {
            p.Hello: self.hello,  # type: ignore[dict-item]
            p.Ping: self.ping,  # type: ignore[dict-item]
            p.Lookup: self.lookup,  # type: ignore[dict-item]
            p.PrepareStore: self.prepare_store,  # type: ignore[dict-item]
            p.CommitStore: self.commit_store,  # type: ignore[dict-item]
            p.Release: self.release,  # type: ignore[dict-item]
            p.StoreInline: self.store_inline,  # type: ignore[dict-item]
            p.RetrieveInline: self.retrieve_inline,  # type: ignore[dict-item]
            p.EndSession: self.end_session,  # type: ignore[dict-item]
            p.Clear: self.clear,  # type: ignore[dict-item]
            p.Stats: self.stats,  # type: ignore[dict-item]
            p.Push: self.push,  # type: ignore[dict-item]
        }

    def hello(self, request: p.Hello, extra: Frames, peer: Peer) -> Handled:
        if request.version != p.PROTOCOL_VERSION:
            raise p.ProtocolError(
                p.ErrorCode.UNSUPPORTED_VERSION,
                f"unsupported protocol version {request.version}; "
                f"this agent speaks version {p.PROTOCOL_VERSION}",
                request.req,
            )
        principal = self._authority.authenticate(request.token) if request.token else None
        if principal is None:
            raise p.ProtocolError(
                p.ErrorCode.UNAUTHENTICATED,
                "hello needs a token of this pool (a KVCacheTenant's, an engine's or an "
                + ("admin's); this one is unknown" if request.token else "admin's); none given"),
                request.req,
            )
        if principal.role is Role.GATEWAY:
            raise p.ProtocolError(
                p.ErrorCode.FORBIDDEN,
                "a gateway token is for the prefix index's routing API, not the agent",
                request.req,
            )
        if not self._admit(peer):
            return None  # closed: max_connections connections have said hello
        session_id = self._sessions.open(
            request.client, peer, principal, digest_token(request.token)
        )
        layout = self._segment.layout
        return p.HelloReply(
            request.req,
            p.PROTOCOL_VERSION,
            session_id,
            self.agent_id,
            str(self._segment.path),
            layout.data_offset,
            layout.data_size,
            layout.page_size,
            self._max_inline,
            self._max_keys,
            principal.tenant or "",
            *self._segment.identity,
            str(door_path(self._segment.path)),
        ), []

    def ping(self, request: p.Ping, extra: Frames, peer: Peer) -> Handled:
        self._sessions.get(request.session, peer)
        return p.Pong(request.req, self.agent_id), []

    def lookup(self, request: p.Lookup, extra: Frames, peer: Peer) -> Handled:
        session = self._sessions.get(request.session, peer)
        self.check_keys(request.keys)
        tenant = self._sessions.tenant(session, request.tenant)
        found = self._service.lookup(
            tenant,
            self._sessions.keys(session, tenant, request),
            lock=request.lock,
            count=request.count,
            prefetch=request.prefetch,
            parent=request.parent,
        )
        hit = found
        if hit.lease is not None:
            session.leases.add(hit.lease)
        file = self._service.file_id(tenant) if hit.count else 0
        return p.LookupReply(
            request.req, hit.lease or p.NO_LEASE, hit.offsets, hit.sizes, hit.prefetch, file
        ), []

    def prepare_store(self, request: p.PrepareStore, extra: Frames, peer: Peer) -> Handled:
        session = self._sessions.get(request.session, peer)
        self.check_keys(request.keys)
        tenant = self._sessions.tenant(session, request.tenant)
        principal = session.principal
        if principal.role is Role.TENANT and tenant not in (principal.tenant, CANARY_TENANT):
            raise p.ProtocolError(
                p.ErrorCode.FORBIDDEN,
                f"a tenant's token stores into the shared space {tenant} with store_inline "
                "(it maps the space's chunks read-only)",
            )
        if self._draining():
            return p.PrepareStoreReply(request.req, p.NO_LEASE, [], SHUTTING_DOWN), []
        keys = self._sessions.keys(session, tenant, request, request.sizes)
        reservation = self._service.reserve(tenant, keys, request.sizes, request.parent)
        if reservation.lease is not None:
            session.leases.add(reservation.lease)
        offsets = [-1 if place is None else place.offset for place in reservation.placements]
        file = self._service.file_id(tenant) if reservation.lease is not None else 0
        return p.PrepareStoreReply(
            request.req,
            reservation.lease or p.NO_LEASE,
            offsets,
            reservation.refused_reason,
            file,
        ), []

    def commit_store(self, request: p.CommitStore, extra: Frames, peer: Peer) -> Handled:
        session = self._sessions.get(request.session, peer)
        self._sessions.check_owner(session, request.lease)
        committed = self._service.commit(request.lease, request.count)
        session.leases.discard(request.lease)
        return p.CommitReply(request.req, committed), []

    def push(self, request: p.Push, extra: Frames, peer: Peer) -> Handled:
        """Offer the leading run of ``keys`` this agent holds to another node's agent: only
        a tenant this session may act for (the receiver pulls them under that tenant,
        within its quota there)."""
        session = self._sessions.get(request.session, peer)
        self.check_keys(request.keys)
        if any(
            len(key) != KEY_BYTES for key in (*request.keys, request.parent or bytes(KEY_BYTES))
        ):
            raise InvalidRequest(f"keys are {KEY_BYTES} bytes")
        tenant = self._sessions.tenant(session, request.tenant)
        if tenant == CANARY_TENANT:
            raise p.ProtocolError(p.ErrorCode.FORBIDDEN, "the canary tenant is never pushed")
        held = self._service.lookup(tenant, request.keys, lock=False, count=False).count
        unsent: str | None
        if self._offer is None:
            unsent = "this agent has no peers"
        elif not held:
            unsent = "none of the chunks is here"
        else:
            unsent = self._offer(request.node, tenant, request.keys[:held], request.parent)
        return p.PushReply(request.req, unsent), []

    def release(self, request: p.Release, extra: Frames, peer: Peer) -> Handled:
        session = self._sessions.get(request.session, peer)
        self._sessions.check_owner(session, request.lease)
        session.leases.discard(request.lease)
        self._service.release(request.lease)
        return p.Ok(request.req), []

    def store_inline(self, request: p.StoreInline, extra: Frames, peer: Peer) -> Handled:
        session = self._sessions.get(request.session, peer)
        self.check_keys(request.keys)
        tenant = self._sessions.tenant(session, request.tenant)
        if len(extra) != len(request.keys):
            raise InvalidRequest(f"{len(request.keys)} keys but {len(extra)} data frames")
        if self._draining():
            return p.StoreInlineReply(request.req, 0, 0, SHUTTING_DOWN), []
        size = sum(len(frame) for frame in extra)
        if size > self._max_inline:
            raise p.ProtocolError(
                p.ErrorCode.TOO_LARGE,
                f"inline payload of {size} bytes; at most {self._max_inline}",
                request.req,
            )
        keys = self._sessions.keys(session, tenant, request, map(len, extra))
        result = self._service.store(tenant, keys, list(extra), request.parent)
        return p.StoreInlineReply(request.req, result.stored, result.present, result.refused), []

    def retrieve_inline(self, request: p.RetrieveInline, extra: Frames, peer: Peer) -> Handled:
        session = self._sessions.get(request.session, peer)
        self.check_keys(request.keys)
        tenant = self._sessions.tenant(session, request.tenant)
        data = self._service.retrieve(
            tenant, self._sessions.keys(session, tenant, request), self._max_inline
        )
        return p.RetrieveInlineReply(request.req, len(data)), data

    def end_session(self, request: p.EndSession, extra: Frames, peer: Peer) -> Handled:
        session = self._sessions.get(request.session, peer)
        self._sessions.end(session, request.session)
        return p.Ok(request.req), []

    def clear(self, request: p.Clear, extra: Frames, peer: Peer) -> Handled:
        """An admin clears any tenant or all; a tenant's token its own chunks only (and every
        chunk token the doctor's canary)."""
        session = self._sessions.get(request.session, peer)
        role = session.principal.role
        if request.tenant is not None and (role is Role.TENANT or request.tenant == CANARY_TENANT):
            tenant: str | None = self._sessions.tenant(session, request.tenant)
            if role is Role.TENANT and tenant not in (session.principal.tenant, CANARY_TENANT):
                raise p.ProtocolError(
                    p.ErrorCode.FORBIDDEN, "a shared space's chunks are cleared by an admin only"
                )
        elif role is Role.ADMIN:
            tenant = request.tenant
            if tenant is not None:
                check_tenant(tenant)
        else:
            raise p.ProtocolError(p.ErrorCode.FORBIDDEN, f"{session.principal} may not clear")
        return p.ClearReply(request.req, self._service.clear(tenant)), []

    def check_snapshot(self, request: p.Snapshot, peer: Peer) -> None:
        """Raise what a snapshot request gets instead of its keys (the server's thread)."""
        session = self._sessions.get(request.session, peer)
        if session.principal.role not in (Role.ADMIN, Role.INDEX):
            raise p.ProtocolError(
                p.ErrorCode.FORBIDDEN, "the snapshot is for a prefix index's (or an admin's) token"
            )
        if len(request.tiers) > len(p.TIERS):
            raise p.ProtocolError(
                p.ErrorCode.INVALID_REQUEST,
                f"snapshot: tiers names {len(request.tiers)} tiers; there are {len(p.TIERS)}",
            )

    def snapshot_reply(self, request: p.Snapshot) -> p.SnapshotReply:
        """The keys of a checked snapshot request (any thread: the service locks)."""
        snapshot = self._service.snapshot(request.tiers)
        return p.SnapshotReply(
            request.req, self.agent_id, snapshot.seq, snapshot.keys_by_tenant, snapshot.tiers
        )

    def stats(self, request: p.Stats, extra: Frames, peer: Peer) -> Handled:
        self._sessions.get(request.session, peer)
        stats = self._service.stats()
        summary: dict[str, int | float] = {
            "capacity_bytes": stats.capacity_bytes,
            "allocated_bytes": stats.allocated_bytes,
            "stored_bytes": stats.stored_bytes,
            "chunks": stats.chunks,
            "hits": stats.hits,
            "misses": stats.misses,
            "lock_expiries": stats.lock_expiries,
            "open_leases": stats.open_leases,
            "quarantined_leases": stats.quarantined_leases,
            "quarantined_bytes": stats.quarantined_bytes,
            "fenced_sessions": self._sessions.fenced,
            "fragmentation": stats.fragmentation,
            "sessions": len(self._sessions),
        }
        summary.update({f"evictions_{cause}": count for cause, count in stats.evictions.items()})
        return p.StatsReply(request.req, summary), []

    def check_keys(self, keys: list[bytes]) -> None:
        if len(keys) > self._max_keys:
            raise p.ProtocolError(
                p.ErrorCode.TOO_LARGE, f"{len(keys)} keys; at most {self._max_keys} per request"
            )
