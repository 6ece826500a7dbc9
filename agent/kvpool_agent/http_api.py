"""The agent's HTTP API: health, cache status, tenant quotas, usage and clearing.

:func:`create_app` gets every dependency as an argument; the composition root
builds the service and the token authority and passes them in.

Access: ``/healthz``, ``/readyz`` and ``/metrics`` need no token. Every other
route takes ``Authorization: Bearer <token>``: an admin token may do anything,
a tenant token only reads and changes its own tenant's quota (within the ceiling its
KVCacheTenant sets), usage and cache, and a gateway token (the prefix index's)
nothing here. Tokens come from the tokens file and, with ``tenants_configmap``, from
the pool's KVCacheTenants (the operator's token is an admin's). Checks run in this order:
a missing or unknown token is 401, a gateway token 403, a malformed tenant id
422, a tenant touching another tenant or an admin-only route 403. A request
with a body is checked for its size (413) and token before the body is read
(:class:`~kvpool_agent.http_body_gate.BodyGate`). Every error body is
``{"detail": "<reason>"}``.

Handlers that reach the service are plain ``def``: FastAPI runs them in its
thread pool, so the service's locks and the quota store's file I/O never block
the event loop.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Query, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt

from kvpool_agent.auth import (
    TENANT_ID_PATTERN,
    TENANT_ID_RULE,
    Principal,
    Role,
    TokenAuthority,
    is_tenant_id,
)
from kvpool_agent.cache_types import TenantStats
from kvpool_agent.http_body_gate import BodyGate
from kvpool_agent.http_common import (
    BearerAuth,
    Error,
    MetricsSource,
    bearer_principal,
    health_routes,
    on_invalid_request,
    on_method_not_allowed,
)
from kvpool_agent.http_limits import HttpLimits
from kvpool_agent.l2.base import TierUnavailable
from kvpool_agent.quota_store import QuotaStoreError
from kvpool_agent.quotas import TierLimits
from kvpool_agent.service import AboveCeiling, CacheService, QuotaView

log = logging.getLogger(__name__)

MAX_LIMIT_BYTES = 2**53
"""Largest quota accepted (8 PiB): every integer up to it is exact as a JSON double, so a
client that holds numbers as doubles (JavaScript, many JSON Schema validators) never sends
a schema-valid value that rounds past the bound."""

TENANT_ID_DOC = "Tenant id: 32 lowercase hex characters, from `kvpool tenant-id <cache_salt>`."
_EXAMPLE_TENANT = "0123456789abcdef0123456789abcdef"

_DESCRIPTION = """\
The node agent's control API. Send `Authorization: Bearer <token>`: an admin token
may use every route, a tenant token only its own tenant's routes. `/healthz`,
`/readyz` and `/metrics` need no token. Errors are `{"detail": "<reason>"}`.
Tenant ids are `kvpool tenant-id <cache_salt>`: 32 lowercase hex characters.
"""

# ------------------------------------------------------------------ models


class CacheStatus(BaseModel):
    """State of the node's L1 cache (all tenants)."""

    capacity_bytes: int = Field(description="Bytes of chunk data the L1 segment holds.")
    allocated_bytes: int = Field(description="Bytes in allocated pages (whole pages per chunk).")
    stored_bytes: int = Field(description="Bytes of chunk data stored (being written or ready).")
    chunks: int = Field(description="Chunks in the index.")
    hits: int = Field(description="Chunks found by lookups since start.")
    misses: int = Field(description="Chunks looked up and not found since start.")
    written_bytes: int = Field(description="Bytes of chunks committed since start.")
    read_bytes: int = Field(description="Bytes of chunks handed to readers since start.")
    evictions: dict[str, int] = Field(
        description="Chunks evicted since start, by cause: watermark, pressure, quota."
    )
    lock_expiries: int = Field(description="Leases that expired instead of being released.")
    open_leases: int = Field(description="Read and write leases open now.")
    quarantined_leases: int = Field(
        description="Write leases that expired before their commit since start (their pages "
        "were held back from reuse: a stalled writer may still copy into them)."
    )
    quarantined_bytes: int = Field(description="Bytes in pages held back that way now.")
    free_extents: int = Field(description="Runs of free pages.")
    fragmentation: float = Field(
        description="External fragmentation: 1 - largest free extent / free bytes."
    )
    page_waste: float = Field(
        description="Share of allocated bytes lost to rounding chunks up to whole pages."
    )
    tenant_count: int = Field(
        description="Tenant records: tenants holding chunks or a quota, and the most recently "
        "active of those holding nothing (up to a bound)."
    )


class Quota(BaseModel):
    tenant: str = Field(description="Tenant id (32 lowercase hex characters).")
    limit_bytes: int | None = Field(
        description="Bytes the tenant may keep in L1; 0 = no caching, null = unlimited."
    )
    nvme_limit_bytes: int | None = Field(
        description="Bytes the tenant may keep in this node's NVMe tier; null = unlimited."
    )
    explicit: bool = Field(
        description="True if the tenant has its own quota; false if the default applies "
        "(lowered to the tenant's ceiling, if its KVCacheTenant sets one)."
    )

    @classmethod
    def of(cls, view: QuotaView) -> Self:
        return cls(
            tenant=view.tenant,
            limit_bytes=view.limits.l1,
            nvme_limit_bytes=view.limits.nvme,
            explicit=view.explicit,
        )


def _integral_float_as_int(value: object) -> object:
    """JSON Schema's integer includes 4096.0: take it as 4096 (1.5, "1" and true still fail)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


_LimitBytes = (
    Annotated[StrictInt, Field(ge=0, le=MAX_LIMIT_BYTES), BeforeValidator(_integral_float_as_int)]
    | None
)


class QuotaUpdate(BaseModel):
    """A tenant's new quota, stored durably and applied at once (shrinking evicts).

    A tenant's own token may set at most its ceiling in each tier (403 above it).
    """

    model_config = ConfigDict(extra="forbid")

    limit_bytes: _LimitBytes = Field(
        description="Bytes the tenant may keep in L1: an integer >= 0 (0 = no caching), "
        "or null for unlimited.",
        examples=[8 << 30, 0, None],
    )
    nvme_limit_bytes: _LimitBytes = Field(
        None,
        description="Bytes the tenant may keep in the NVMe tier, or null for unlimited; "
        "absent: the same as limit_bytes.",
        examples=[64 << 30],
    )

    def limits(self) -> TierLimits:
        if "nvme_limit_bytes" not in self.model_fields_set:
            return TierLimits.both(self.limit_bytes)
        return TierLimits(self.limit_bytes, self.nvme_limit_bytes)


class Usage(BaseModel):
    tenant: str = Field(description="Tenant id.")
    used_bytes: int = Field(description="Bytes of the tenant's chunks in L1.")
    nvme_used_bytes: int = Field(
        description="Bytes of the tenant's files in this node's NVMe tier; 0 without one."
    )
    chunks: int = Field(description="The tenant's chunks in L1.")
    quota_bytes: int | None = Field(description="The tenant's quota; null = unlimited.")
    hits: int = Field(description="Chunks the tenant found since start.")
    misses: int = Field(description="Chunks the tenant looked up and did not find.")
    stored_chunks: int = Field(description="Chunks the tenant stored since start.")
    evicted_chunks: int = Field(description="The tenant's chunks evicted since start.")

    @classmethod
    def of(cls, stats: TenantStats, nvme_used_bytes: int) -> Self:
        return cls(
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


class TenantUsages(BaseModel):
    """Every tenant the cache has an account for; counters run since the agent started."""

    tenants: list[Usage] = Field(description="One entry per tenant, in no particular order.")


class Cleared(BaseModel):
    dropped_chunks: int = Field(
        description="Chunks dropped; locked ones are freed when their readers finish."
    )
    l2_dropped_objects: int | None = Field(
        None,
        description="With tiers=all: objects deleted from the L2 tiers (this node's NVMe "
        "files and the pool's S3 objects of the tenant); null otherwise.",
    )


# ----------------------------------------------------------------- errors

Responses = dict[int | str, dict[str, Any]]

_ERRORS: dict[int | str, str] = {
    401: "Missing or unknown bearer token.",
    403: "The token may not use this route (another tenant's, admin-only, or a gateway's).",
    413: "Request body larger than http_limits.max_body_bytes (refused before it is read).",
    422: "Malformed tenant id or request body.",
    503: "The quota store failed; nothing was changed.",
    "ceiling": "The token may not use this route (another tenant's, admin-only, or a "
    "gateway's), or a tenant's own token asked for more than its ceiling.",
    "tiers": "An L2 tier could not finish the drop (L1 is dropped); try again.",
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


def _guards(auth: BearerAuth) -> _Guards:
    authenticate = bearer_principal(
        auth, description="An admin token, or a tenant token for that tenant's own routes."
    )

    def admin(principal: Annotated[Principal, Depends(authenticate)]) -> Principal:
        if not principal.is_admin:
            raise HTTPException(status.HTTP_403_FORBIDDEN, "this route needs an admin token")
        return principal

    def tenant(
        tenant_id: Annotated[
            str,
            Path(
                description=TENANT_ID_DOC,
                examples=[_EXAMPLE_TENANT],
                # declared, not enforced by FastAPI: the check below runs after the token's
                json_schema_extra={"pattern": TENANT_ID_PATTERN},
            ),
        ],
        principal: Annotated[Principal, Depends(authenticate)],
    ) -> TenantAccess:
        if not is_tenant_id(tenant_id):
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, TENANT_ID_RULE)
        if not principal.may_access(tenant_id):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN, "a tenant token may only access its own tenant"
            )
        return TenantAccess(tenant_id, principal)

    return _Guards(admin, tenant)


# -------------------------------------------------------------------- app


def create_app(
    service: CacheService,
    authority: TokenAuthority,
    *,
    ready: Callable[[], bool] | None = None,
    metrics: MetricsSource | None = None,
    limits: HttpLimits | None = None,
) -> FastAPI:
    """The HTTP API over ``service``, guarded by ``authority``.

    ``ready`` answers ``/readyz`` (default: ready whenever the app serves).
    ``metrics``, if given, is served at ``/metrics`` without a token.
    ``limits`` bound request bodies (:class:`~kvpool_agent.http_body_gate.BodyGate`).
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
    guards = _guards(auth)
    app.include_router(health_routes(ready or _always, metrics, what="agent"))
    app.include_router(_cache_routes(service, guards))
    app.include_router(_tenant_routes(service, guards))
    return app


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
            tenants=[
                Usage.of(stats, service.nvme_used(stats.tenant)) for stats in service.tenants()
            ]
        )

    @router.post(
        "/clear",
        summary="Drop every cached chunk of every tenant (admin).",
        response_model_exclude_none=True,
    )
    def clear_all(principal: Admin) -> Cleared:
        dropped = service.clear()
        log.info("%s cleared the cache: %d chunks dropped", principal, dropped)
        return Cleared(dropped_chunks=dropped)

    return router


def _tenant_routes(service: CacheService, guards: _Guards) -> APIRouter:
    router = APIRouter(
        prefix="/v1/tenants/{tenant_id}", tags=["tenants"], responses=_errors(401, 403, 422)
    )
    Tenant = Annotated[TenantAccess, Depends(guards.tenant)]

    @router.get("/quota", summary="A tenant's quota (admin or that tenant).")
    def get_quota(access: Tenant) -> Quota:
        return Quota.of(service.quota(access.tenant))

    @router.put(
        "/quota",
        summary="Set a tenant's quota durably; shrinking evicts at once (admin, or that "
        "tenant within its ceiling).",
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
        return Quota.of(view)

    @router.delete(
        "/quota",
        summary="Revert a tenant to the default quota (admin or that tenant).",
        responses=_errors(503),
    )
    def delete_quota(access: Tenant) -> Quota:
        view = service.delete_quota(access.tenant)
        log.info("%s reverted the quota of tenant %s to the default", access.principal, view.tenant)
        return Quota.of(view)

    @router.get("/usage", summary="A tenant's cache usage and counters (admin or that tenant).")
    def get_usage(access: Tenant) -> Usage:
        return Usage.of(service.usage(access.tenant), service.nvme_used(access.tenant))

    @router.post(
        "/clear",
        summary="Drop a tenant's cached chunks from L1, or with tiers=all from L2 too "
        "(admin or that tenant).",
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
        if tiers == "l1":
            dropped = service.clear(access.tenant)
            log.info(
                "%s cleared tenant %s: %d chunks dropped", access.principal, access.tenant, dropped
            )
            return Cleared(dropped_chunks=dropped)
        try:
            both = service.drop_tenant(access.tenant)
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


def _bytes(limit: int | None) -> str:
    return "unlimited" if limit is None else f"{limit} bytes"


def _limits(view: QuotaView) -> str:
    l1, nvme = view.limits.l1, view.limits.nvme
    return _bytes(l1) if l1 == nvme else f"{_bytes(l1)} in L1, {_bytes(nvme)} in NVMe"
