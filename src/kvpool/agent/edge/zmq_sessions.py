"""The ZMQ edge's sessions: each client's, opened by a hello with a token of the pool.

A session belongs to the connection that opened it, holds its leases and its principal
(whose token is checked again when the granted tokens change), and ends when the client
ends it or after ``session_idle_seconds`` without a request. A session that held a write
lease which expired before its commit is fenced; one whose token is revoked is voided:
both are refused from then on, and their leases left to the idle sweep, so that pages a
late copy may still write stay quarantined until then. The table also says which tenant a
session's request acts on, and scopes the doctor's canary keys to the session.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvpool.agent.core.cache_types import InvalidRequest
from kvpool.agent.service.data_service import DataService
from kvpool.common import protocol as p
from kvpool.common.auth import Principal, Role, TokenAuthority
from kvpool.common.keys import (
    CANARY_CHUNK_BYTES,
    CANARY_TENANT,
    TENANT_ID_RULE,
    canary_key,
    is_tenant_id,
    tenant_id,
)

log = logging.getLogger(__name__)

Peer = bytes
"""The routing identity of the connection a request came on."""
DEFAULT_TENANT = tenant_id(None)
"""The tenant of requests without a ``cache_salt``."""
_CHUNK_ROLES = frozenset((Role.ADMIN, Role.ENGINE, Role.TENANT))
"""Roles whose tokens touch chunks."""
KeyedRequest = p.Lookup | p.PrepareStore | p.StoreInline | p.RetrieveInline


@dataclass
class Session:
    client: str
    peer: Peer
    principal: Principal
    digest: bytes
    """Of the token that opened it: checked again when the granted tokens change."""
    leases: set[int] = field(default_factory=set)
    last_seen: float = 0.0
    fenced: bool = False
    revoked: bool = False
    canary_scope: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    """What makes this session's canary keys its own (see keys.canary_key)."""


class SessionTable:
    def __init__(
        self,
        service: DataService,
        authority: TokenAuthority,
        *,
        agent_id: str,
        idle_seconds: float,
        clock: Callable[[], float],
    ) -> None:
        self._service = service
        self._authority = authority
        self._generation_seen = authority.generation
        self.agent_id = agent_id
        self._idle = idle_seconds
        self._clock = clock
        self._sessions: dict[int, Session] = {}
        self._quarantines_seen = 0
        self.fenced = 0
        """Sessions fenced since the start."""

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, client: str, peer: Peer, principal: Principal, digest: bytes) -> int:
        """A new session of ``client`` on connection ``peer``; its id."""
        session_id = self._new_session_id()
        self._sessions[session_id] = Session(
            client, peer, principal, digest, last_seen=self._clock()
        )
        return session_id

    def end(self, session: Session, session_id: int) -> None:
        """End ``session`` (``session_id``) and its leases."""
        self.end_leases(session.leases)
        del self._sessions[session_id]

    def get(self, session_id: int, peer: Peer) -> Session:
        """The caller's live session; fenced ones are refused without refreshing ``last_seen``,
        so they are swept (and their quarantined pages freed) ``session_idle`` after."""
        session = self._sessions.get(session_id)
        if session is None or session.peer != peer:
            raise p.ProtocolError(
                p.ErrorCode.UNKNOWN_SESSION,
                f"session {session_id} is unknown on this connection "
                f"(agent {self.agent_id} restarted?); send hello",
            )
        if session.revoked:
            raise p.ProtocolError(
                p.ErrorCode.UNAUTHENTICATED,
                f"the token of session {session_id} was revoked; its leases are void",
            )
        if session.fenced:
            raise p.ProtocolError(
                p.ErrorCode.SESSION_FENCED,
                f"session {session_id} held a write lease that expired before its commit; "
                "its leases are void; send hello for a new session",
            )
        session.last_seen = self._clock()
        return session

    def _new_session_id(self) -> int:
        while True:
            session_id = secrets.randbits(64)
            if session_id not in self._sessions:
                return session_id

    def fence_expired_writers(self) -> None:
        """Fence the sessions whose write leases were quarantined since the last look.

        The count is read without the lock: the common case costs one compare.
        """
        quarantines = self._service.quarantined_leases
        if quarantines == self._quarantines_seen:
            return
        self._quarantines_seen = quarantines
        live = [session for session in self._sessions.values() if not session.fenced]
        held = self._service.holding_quarantined([session.leases for session in live])
        for session, quarantined in zip(live, held, strict=True):
            if quarantined:
                session.fenced = True
                self.fenced += 1
                log.warning(  # not the session id: it is the session's credential
                    "a session of client %r held a write lease that expired before its "
                    "commit: session fenced, its pages quarantined",
                    session.client,
                )

    def void_revoked(self) -> None:
        """Void the sessions whose token is no longer granted (one compare when nothing
        changed). Their leases are left to the idle sweep, as a fenced session's."""
        generation = self._authority.generation
        if generation == self._generation_seen:
            return
        self._generation_seen = generation
        for session in self._sessions.values():
            if not session.revoked and not self._authority.holds(session.digest, session.principal):
                session.revoked = True
                log.warning(
                    "a session of client %r lost its token (%s revoked): session voided",
                    session.client,
                    session.principal,
                )

    def tenant(self, session: Session, tenant: str) -> str:
        """The tenant a request of ``session`` naming ``tenant`` acts on, if it may."""
        principal = session.principal
        if tenant == CANARY_TENANT and principal.role in _CHUNK_ROLES:
            return tenant
        if principal.role is Role.TENANT:
            assert principal.tenant is not None
            if tenant == DEFAULT_TENANT:
                return principal.tenant
            if self._authority.may_use(principal, tenant):
                return tenant
            raise p.ProtocolError(
                p.ErrorCode.FORBIDDEN,
                f"this token acts for tenant {principal.tenant} and its shared spaces only, "
                f"not {tenant[:40]!r}",
            )
        if principal.role in (Role.ADMIN, Role.ENGINE):
            check_tenant(tenant)
            return tenant
        raise p.ProtocolError(p.ErrorCode.FORBIDDEN, f"{principal} tokens touch no chunk")

    def keys(
        self, session: Session, tenant: str, request: KeyedRequest, sizes: Iterable[int] = ()
    ) -> list[bytes]:
        """The keys ``request`` acts on in ``tenant``: its own; in the canary tenant, their
        scope in this session, once its chunks (of ``sizes`` bytes) are canary chunks."""
        if tenant != CANARY_TENANT:
            return request.keys
        if getattr(request, "parent", None) is not None:
            raise InvalidRequest(f"the canary tenant {CANARY_TENANT} takes no parent")
        wrong = next((size for size in sizes if size != CANARY_CHUNK_BYTES), None)
        if wrong is not None:
            raise InvalidRequest(
                f"the canary tenant {CANARY_TENANT} takes chunks of {CANARY_CHUNK_BYTES} "
                f"bytes only, not {wrong}"
            )
        return [canary_key(session.canary_scope, key) for key in request.keys]

    def check_owner(self, session: Session, lease: int) -> None:
        if lease not in session.leases:
            raise p.ProtocolError(
                p.ErrorCode.NOT_YOUR_LEASE, f"lease {lease} was not granted to this session"
            )

    def end_leases(self, leases: set[int]) -> None:
        self._service.release_all(leases)
        leases.clear()

    def drop_idle(self) -> None:
        cutoff = self._clock() - self._idle
        for session_id, session in list(self._sessions.items()):
            if session.last_seen < cutoff:
                self.end_leases(session.leases)
                del self._sessions[session_id]


def check_tenant(tenant: str) -> None:
    """Every operation names a tenant id (see keys.tenant_id), never anything else: a lookup
    with a 10 MiB name would otherwise cost the agent a tenant record of that size."""
    if not is_tenant_id(tenant):
        raise InvalidRequest(TENANT_ID_RULE)
