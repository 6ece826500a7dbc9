"""The agent's HTTP API: health, cache status, tenant quotas, usage and clearing, pins and
warming, usage per shared space, and the state of this agent's peers.

:func:`create_app` gets every dependency as an argument; the composition root
builds the service and the token authority and passes them in.

Access: ``/healthz``, ``/readyz`` and ``/metrics`` need no token. Every other route
takes ``Authorization: Bearer <token>``: an admin token may do anything, a tenant token
only reads and changes its own tenant's quota (within the ceiling its KVCacheTenant
sets, or without one the default quota), usage and cache, and a gateway token (the
prefix index's) nothing here. Pins and warming take an admin token, or the token of an
owner of the shared space (:meth:`~kvpool.common.auth.TokenAuthority.may_pin`).
Tokens come from the tokens file and, with ``tenants_configmap``, from the pool's
KVCacheTenants (the operator's token is an admin's). Checks run in this order: a missing
or unknown token is 401, a gateway token 403, a malformed tenant id 422, a tenant touching
another tenant (or pinning where it owns no space) or an admin-only route 403. A request
with a body is checked for its size (413) and token before the body is read
(:class:`~kvpool.common.web.body_gate.BodyGate`). Every error body is ``{"detail":
"<reason>"}``.

Handlers that reach the service are plain ``def``: FastAPI runs them in its
thread pool, so the service's locks and the quota store's file I/O never block
the event loop.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Query, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from kvpool.agent.core.cache_types import PinRefused, PinState, TenantPins, TenantStats
from kvpool.agent.l2.base import TierUnavailable
from kvpool.agent.service.cache_service import CacheService
from kvpool.agent.service.pin_service import PinService
from kvpool.agent.service.results import AboveCeiling, QuotaView, WarmRefused
from kvpool.agent.tenancy.quota_store import QuotaStoreError
from kvpool.common.api_models import (
    PIN_NAME_PATTERN,
    CacheStatus,
    Cleared,
    Peers,
    Pin,
    Pins,
    PinUpdate,
    Quota,
    QuotaUpdate,
    Spaces,
    SpaceUsage,
    TenantUsages,
    Usage,
    Warmed,
    WarmRequest,
)
from kvpool.common.auth import Principal, Role, TokenAuthority
from kvpool.common.config import HttpLimits
from kvpool.common.keys import TENANT_ID_PATTERN, TENANT_ID_RULE, is_tenant_id
from kvpool.common.web.body_gate import BodyGate
from kvpool.common.web.common import (
    BearerAuth,
    Error,
    MetricsSource,
    bearer_principal,
    health_routes,
    on_invalid_request,
    on_method_not_allowed,
)

log = logging.getLogger(__name__)

TENANT_ID_DOC = "Tenant id: 32 lowercase hex characters, from `kvpool tenant-id <cache_salt>`."
_EXAMPLE_TENANT = "0123456789abcdef0123456789abcdef"

_DESCRIPTION = """\
The node agent's control API. Send `Authorization: Bearer <token>`: an admin token
may use every route, a tenant token only its own tenant's routes. `/healthz`,
`/readyz` and `/metrics` need no token. Errors are `{"detail": "<reason>"}`.
Tenant ids are `kvpool tenant-id <cache_salt>`: 32 lowercase hex characters.
"""

# ----------------------------------------------------------------- errors

Responses = dict[int | str, dict[str, Any]]

_ERRORS: dict[int | str, str] = {
    401: "Missing or unknown bearer token.",
    403: "The token may not use this route (another tenant's, admin-only, or a gateway's).",
    413: "Request body larger than http_limits.max_body_bytes (refused before it is read).",
    422: "Malformed tenant id or request body.",
    404: "The tenant has no pin of that name.",
    409: "The tenant's pin budget is 0 bytes (pinning is off for it), or its pins would "
    "name more keys than one tenant's pins may.",
    503: "The quota store failed; nothing was changed.",
    "ceiling": "The token may not use this route (another tenant's, admin-only, or a "
    "gateway's), or a tenant's own token asked for more than its ceiling (without a "
    "KVCacheTenant ceiling: the default tenant quota; unlimited is more than either).",
    "tiers": "An L2 tier could not finish the drop (L1 is dropped); try again.",
    "pin": "The token may not pin or warm for this tenant: an admin's, or a token of an "
    "owner of the shared space, may.",
    "warm": "Too many loads from L2 are in flight to start one; try again.",
    "peers": "This agent has no peers (its configuration has no peers section).",
}


def _errors(*codes: int) -> Responses:
    """OpenAPI entries for the error responses a route may give."""
    return {code: {"model": Error, "description": _ERRORS[code]} for code in codes}


def _error(code: int, reason: str) -> Responses:
    """An OpenAPI entry for ``code``, with its description for one route (``_ERRORS[reason]``)."""
    return {code: {"model": Error, "description": _ERRORS[reason]}}


async def _on_store_error(request: Request, error: Exception) -> JSONResponse:
    log.error("quota store failed on %s %s: %s", request.method, request.url.path, error)
    return JSONResponse(
        {"detail": f"quota store unavailable, nothing was changed: {error}"}, status_code=503
    )


# ----------------------------------------------------------------- access


@dataclass(frozen=True, slots=True)
class TenantAccess:
    """A request allowed to act on ``tenant``, and who made it."""

    tenant: str
    principal: Principal


@dataclass(frozen=True, slots=True)
class _Guards:
    """FastAPI dependencies that authenticate and authorize a request."""

    admin: Callable[..., Principal]
    tenant: Callable[..., TenantAccess]
    pinner: Callable[..., TenantAccess]
    """Pins and warms: an admin, or an owner of the shared space."""


_TenantId = Annotated[
    str,
    Path(
        description=TENANT_ID_DOC,
        examples=[_EXAMPLE_TENANT],
        # declared, not enforced by FastAPI: the guards check it after the token
        json_schema_extra={"pattern": TENANT_ID_PATTERN},
    ),
]


def _check_tenant_id(tenant_id: str) -> None:
    if not is_tenant_id(tenant_id):
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, TENANT_ID_RULE)


def _guards(auth: BearerAuth, authority: TokenAuthority) -> _Guards:
    authenticate = bearer_principal(
        auth, description="An admin token, or a tenant token for that tenant's own routes."
    )

    def admin(principal: Annotated[Principal, Depends(authenticate)]) -> Principal:
        if not principal.is_admin:
            raise HTTPException(status.HTTP_403_FORBIDDEN, "this route needs an admin token")
        return principal

    def tenant(
        tenant_id: _TenantId, principal: Annotated[Principal, Depends(authenticate)]
    ) -> TenantAccess:
        _check_tenant_id(tenant_id)
        if not principal.may_access(tenant_id):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN, "a tenant token may only access its own tenant"
            )
        return TenantAccess(tenant_id, principal)

    def pinner(
        tenant_id: _TenantId, principal: Annotated[Principal, Depends(authenticate)]
    ) -> TenantAccess:
        _check_tenant_id(tenant_id)
        if not authority.may_pin(principal, tenant_id):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                "pinning and warming need an admin token, or a token of an owner of the "
                "shared space",
            )
        return TenantAccess(tenant_id, principal)

    return _Guards(admin, tenant, pinner)


# -------------------------------------------------------------------- app


def create_app(
    service: CacheService,
    authority: TokenAuthority,
    *,
    ready: Callable[[], bool] | None = None,
    metrics: MetricsSource | None = None,
    limits: HttpLimits | None = None,
    peers: Callable[[bool], Peers] | None = None,
) -> FastAPI:
    """The HTTP API over ``service``, guarded by ``authority``.

    ``ready`` answers ``/readyz`` (default: ready whenever the app serves).
    ``metrics``, if given, is served at ``/metrics`` without a token.
    ``limits`` bound request bodies (:class:`~kvpool.common.web.body_gate.BodyGate`).
    ``peers`` answers ``/v1/peers`` (its argument: probe every peer first); without it
    that route is 404 (no peers configured).
    """
    app = FastAPI(
        title="kvpool agent",
        summary="Node-local KV cache agent for vLLM: status, tenant quotas and usage.",
        description=_DESCRIPTION,
        version="1",
    )
    app.add_exception_handler(RequestValidationError, on_invalid_request)
    app.add_exception_handler(QuotaStoreError, _on_store_error)
    app.add_exception_handler(status.HTTP_405_METHOD_NOT_ALLOWED, on_method_not_allowed)
    auth = BearerAuth(authority, realm="kvpool", roles=(Role.ADMIN, Role.TENANT))
    app.add_middleware(BodyGate, auth=auth, limits=limits or HttpLimits())
    guards = _guards(auth, authority)
    app.include_router(health_routes(ready or _always, metrics, what="agent"))
    app.include_router(_cache_routes(service, guards))
    app.include_router(_tenant_routes(service, guards))
    app.include_router(_pin_routes(service, guards))
    app.include_router(_peer_routes(peers, guards))
    return app


def _peer_routes(peers: Callable[[bool], Peers] | None, guards: _Guards) -> APIRouter:
    router = APIRouter(
        prefix="/v1", tags=["peers"], responses={**_errors(401, 403), **_error(404, "peers")}
    )
    Admin = Annotated[Principal, Depends(guards.admin)]

    @router.get(
        "/peers",
        summary="This agent's peers (the pool's other agents) and what it serves them (admin).",
    )
    def peer_state(
        _: Admin,
        probe: Annotated[
            bool, Query(description="Connect to every peer now (kvpool doctor's check).")
        ] = False,
    ) -> Peers:
        if peers is None:
            raise HTTPException(
                status.HTTP_404_NOT_FOUND, "this agent has no peers (no peers section)"
            )
        return peers(probe)

    return router


def _always() -> bool:
    return True


def _cache_routes(service: CacheService, guards: _Guards) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["cache"], responses=_errors(401, 403))
    Admin = Annotated[Principal, Depends(guards.admin)]

    @router.get("/status", summary="L1 cache state, all tenants together (admin).")
    def cache_status(_: Admin) -> CacheStatus:
        stats = service.stats()
        return CacheStatus(
            capacity_bytes=stats.capacity_bytes,
            allocated_bytes=stats.allocated_bytes,
            stored_bytes=stats.stored_bytes,
            chunks=stats.chunks,
            hits=stats.hits,
            misses=stats.misses,
            written_bytes=stats.written_bytes,
            read_bytes=stats.read_bytes,
            evictions=dict(stats.evictions),
            lock_expiries=stats.lock_expiries,
            open_leases=stats.open_leases,
            quarantined_leases=stats.quarantined_leases,
            quarantined_bytes=stats.quarantined_bytes,
            free_extents=stats.free_extents,
            fragmentation=stats.fragmentation,
            page_waste=stats.page_waste,
            tenant_count=stats.tenant_count,
        )

    @router.get(
        "/tenants",
        tags=["tenants"],
        summary="Every tenant's cache usage and counters since start (admin).",
    )
    def list_tenants(_: Admin) -> TenantUsages:
        return TenantUsages(
            tenants=[_usage(stats, service.nvme_used(stats.tenant)) for stats in service.tenants()]
        )

    @router.post(
        "/clear",
        summary="Drop every cached chunk and every pin of every tenant (admin).",
        response_model_exclude_none=True,
    )
    def clear_all(principal: Admin) -> Cleared:
        dropped = service.clear(unpin=True)
        log.info("%s cleared the cache: %d chunks dropped", principal, dropped)
        return Cleared(dropped_chunks=dropped)

    @router.get(
        "/spaces",
        tags=["tenants"],
        summary="Every shared space of the tenants ConfigMap: usage and pins (admin).",
    )
    def list_spaces(_: Admin) -> Spaces:
        return Spaces(
            spaces=[
                SpaceUsage(
                    space=space.space,
                    source=space.source,
                    members=space.members,
                    owners=space.owners,
                    usage=_usage(space.usage, space.nvme_used_bytes),
                    pinned_bytes=space.pinned_bytes,
                    pin_budget_bytes=space.pin_budget_bytes,
                )
                for space in service.spaces()
            ]
        )

    return router


def _tenant_routes(service: CacheService, guards: _Guards) -> APIRouter:
    router = APIRouter(
        prefix="/v1/tenants/{tenant_id}", tags=["tenants"], responses=_errors(401, 403, 422)
    )
    Tenant = Annotated[TenantAccess, Depends(guards.tenant)]

    @router.get("/quota", summary="A tenant's quota (admin or that tenant).")
    def get_quota(access: Tenant) -> Quota:
        return _quota(service.quota(access.tenant))

    @router.put(
        "/quota",
        summary="Set a tenant's quota durably; shrinking evicts at once (admin, or that "
        "tenant within its ceiling or, without one, the default quota).",
        responses={**_errors(413, 503), **_error(403, "ceiling")},
    )
    def put_quota(access: Tenant, update: QuotaUpdate) -> Quota:
        try:
            view = service.set_quota(
                access.tenant, update.limits(), within_ceiling=not access.principal.is_admin
            )
        except AboveCeiling as error:
            raise HTTPException(status.HTTP_403_FORBIDDEN, str(error)) from None
        log.info(
            "%s set the quota of tenant %s to %s", access.principal, view.tenant, _limits(view)
        )
        return _quota(view)

    @router.delete(
        "/quota",
        summary="Revert a tenant to the default quota (admin or that tenant).",
        responses=_errors(503),
    )
    def delete_quota(access: Tenant) -> Quota:
        view = service.delete_quota(access.tenant)
        log.info("%s reverted the quota of tenant %s to the default", access.principal, view.tenant)
        return _quota(view)

    @router.get("/usage", summary="A tenant's cache usage and counters (admin or that tenant).")
    def get_usage(access: Tenant) -> Usage:
        return _usage(service.usage(access.tenant), service.nvme_used(access.tenant))

    @router.post(
        "/clear",
        summary="Drop a tenant's cached chunks from L1, or with tiers=all from L2 too "
        "(admin or that tenant); an admin's drops its pins too.",
        responses=_error(503, "tiers"),
        response_model_exclude_none=True,
    )
    def clear_tenant(
        access: Tenant,
        tiers: Annotated[
            Literal["l1", "all"],
            Query(
                description="l1: this node's L1 only. all: also this node's NVMe files and "
                "the pool's S3 objects of the tenant (when its KVCacheTenant is deleted)."
            ),
        ] = "l1",
    ) -> Cleared:
        unpin = access.principal.is_admin
        if tiers == "l1":
            dropped = service.clear(access.tenant, unpin=unpin)
            log.info(
                "%s cleared tenant %s: %d chunks dropped", access.principal, access.tenant, dropped
            )
            return Cleared(dropped_chunks=dropped)
        try:
            both = service.drop_tenant(access.tenant, unpin=unpin)
        except TierUnavailable as error:
            log.error("%s: dropping tenant %s: %s", access.principal, access.tenant, error)
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE,
                f"L1 is dropped but an L2 tier is not done, try again: {error}",
            ) from None
        log.info(
            "%s dropped tenant %s: %d chunks from L1, %d objects from L2",
            access.principal,
            access.tenant,
            both.l1_chunks,
            both.l2_objects,
        )
        return Cleared(dropped_chunks=both.l1_chunks, l2_dropped_objects=both.l2_objects)

    return router


def _pin_routes(service: PinService, guards: _Guards) -> APIRouter:
    router = APIRouter(
        prefix="/v1/tenants/{tenant_id}",
        tags=["pins"],
        responses={**_errors(401, 422), **_error(403, "pin")},
    )
    Pinner = Annotated[TenantAccess, Depends(guards.pinner)]
    PinName = Annotated[
        str, Path(pattern=PIN_NAME_PATTERN, description="The pin's name.", examples=["system"])
    ]

    @router.get("/pins", summary="A tenant's pins and pin budget (admin or a space's owner).")
    def get_pins(access: Pinner) -> Pins:
        return _pins(service.pins(access.tenant))

    @router.put(
        "/pins/{name}",
        summary="Pin chunks of a tenant in this agent's L1, whether cached yet or not; the "
        "same name replaces the pin (admin or a space's owner).",
        responses=_errors(409, 413),
    )
    def put_pin(access: Pinner, name: PinName, update: PinUpdate) -> Pin:
        try:
            state = service.put_pin(access.tenant, name, [bytes.fromhex(k) for k in update.keys])
        except PinRefused as error:
            raise HTTPException(status.HTTP_409_CONFLICT, str(error)) from None
        log.info(
            "%s pinned %d keys of tenant %s as %r",
            access.principal,
            state.keys,
            access.tenant,
            name,
        )
        return _pin(state)

    @router.delete(
        "/pins/{name}",
        summary="Drop a pin: its chunks stay, evictable (admin or a space's owner).",
        responses=_errors(404),
    )
    def delete_pin(access: Pinner, name: PinName) -> Pins:
        if not service.delete_pin(access.tenant, name):
            raise HTTPException(
                status.HTTP_404_NOT_FOUND, f"tenant {access.tenant} has no pin {name!r}"
            )
        log.info("%s unpinned %r of tenant %s", access.principal, name, access.tenant)
        return _pins(service.pins(access.tenant))

    @router.post(
        "/warm",
        summary="Load a prefix of a tenant's chunks from L2 (NVMe, then S3) into this agent's "
        "L1, waiting up to timeout_s (admin or a space's owner).",
        responses={**_errors(413), **_error(503, "warm")},
    )
    def warm(access: Pinner, request: WarmRequest) -> Warmed:
        keys = [bytes.fromhex(k) for k in request.keys]
        try:
            warmed = service.warm(access.tenant, keys, request.timeout_s)
        except WarmRefused as error:
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, str(error)) from None
        return Warmed(
            keys=warmed.keys,
            resident=warmed.resident,
            loaded=warmed.loaded,
            missing=warmed.missing,
            done=warmed.done,
        )

    return router


def _pin(state: PinState) -> Pin:
    return Pin(
        name=state.name,
        keys=state.keys,
        resident_keys=state.resident,
        pinned_keys=state.pinned,
        pinned_bytes=state.pinned_bytes,
    )


def _pins(pins: TenantPins) -> Pins:
    return Pins(
        tenant=pins.tenant,
        budget_bytes=pins.budget_bytes,
        pinned_bytes=pins.pinned_bytes,
        pins=[_pin(state) for state in pins.pins],
    )


def _bytes(limit: int | None) -> str:
    return "unlimited" if limit is None else f"{limit} bytes"


def _limits(view: QuotaView) -> str:
    l1, nvme = view.limits.l1, view.limits.nvme
    return _bytes(l1) if l1 == nvme else f"{_bytes(l1)} in L1, {_bytes(nvme)} in NVMe"


def _quota(view: QuotaView) -> Quota:
    return Quota(
        tenant=view.tenant,
        limit_bytes=view.limits.l1,
        nvme_limit_bytes=view.limits.nvme,
        explicit=view.explicit,
    )


def _usage(stats: TenantStats, nvme_used_bytes: int) -> Usage:
    return Usage(
        tenant=stats.tenant,
        used_bytes=stats.used_bytes,
        nvme_used_bytes=nvme_used_bytes,
        chunks=stats.chunks,
        quota_bytes=stats.quota_bytes,
        hits=stats.hits,
        misses=stats.misses,
        stored_chunks=stats.stored_chunks,
        evicted_chunks=stats.evicted_chunks,
    )
