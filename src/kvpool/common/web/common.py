"""What the agent's and the index's HTTP APIs share: health routes, error bodies, bearer auth.

Both APIs answer errors as ``{"detail": "<reason>"}``, serve ``/healthz``, ``/readyz``
and ``/metrics`` without a token, and take ``Authorization: Bearer <token>`` from the
pool's tokens file (:mod:`kvpool.common.auth`) everywhere else: a missing or unknown token
is 401, a principal the API does not serve (a gateway on an agent, a tenant on the index)
403.
"""

from collections.abc import Awaitable, Callable, Collection
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import BaseModel, Field
from starlette.datastructures import Headers
from starlette.routing import Match
from starlette.types import Scope

from kvpool.common.auth import Principal, Role, TokenAuthority
from kvpool.common.web.connections import trust

MetricsSource = Callable[[], tuple[bytes, str]]
"""Renders the metrics exposition: ``(body, content_type)``."""


class Error(BaseModel):
    detail: str = Field(description="Why the request failed.")


class Health(BaseModel):
    status: str = Field("ok", description="Always 'ok' while the process serves requests.")


class Readiness(BaseModel):
    ready: bool = Field(description="True when the process serves its requests.")


def health_routes(
    ready: Callable[[], bool], metrics: MetricsSource | None, *, what: str
) -> APIRouter:
    """``/healthz``, ``/readyz`` (``ready`` decides) and, if given, ``/metrics``."""
    router = APIRouter(tags=["health"])

    @router.get("/healthz", summary="Liveness: 200 while the process is up.")
    async def healthz() -> Health:
        return Health()

    @router.get(
        "/readyz",
        summary=f"Readiness: 200 when the {what} serves requests, else 503.",
        responses={503: {"model": Error, "description": "Starting or stopping."}},
    )
    def readyz() -> Readiness:
        if not ready():
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"the {what} is not ready")
        return Readiness(ready=True)

    if metrics is not None:
        render = metrics

        @router.get(
            "/metrics",
            summary="Prometheus metrics (no token needed).",
            response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Metrics."}},
        )
        def metrics_route() -> Response:
            body, content_type = render()
            return Response(content=body, media_type=content_type)

    return router


def invalid_request_reason(error: RequestValidationError) -> str:
    """One clause per problem, e.g. ``body.limit_bytes: Input should be ...``."""
    problems = []
    for item in error.errors():
        location = tuple(item.get("loc", ()))
        if item.get("type") == "json_invalid":
            cause = item.get("ctx", {}).get("error", "malformed")
            at = f" at character {location[1]}" if len(location) > 1 else ""
            problems.append(f"body: not valid JSON ({cause}{at})")
            continue
        where = ".".join(str(part) for part in location)
        message = str(item.get("msg", "invalid"))
        problems.append(f"{where}: {message}" if where else message)
    return "invalid request: " + "; ".join(problems)


async def on_invalid_request(request: Request, error: Exception) -> JSONResponse:
    """FastAPI's handler of RequestValidationError: 422 with :func:`invalid_request_reason`."""
    assert isinstance(error, RequestValidationError)
    return JSONResponse({"detail": invalid_request_reason(error)}, status_code=422)


async def on_method_not_allowed(request: Request, error: Exception) -> JSONResponse:
    """405 naming every method of the path in ``Allow``.

    Starlette's own 405 names only the first route of the path that matched, so
    ``POST /quota`` would say ``Allow: GET`` though PUT and DELETE are served too.
    """
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] is not Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return JSONResponse(
        {"detail": f"method {request.method} not allowed"},
        status_code=status.HTTP_405_METHOD_NOT_ALLOWED,
        headers={"Allow": ", ".join(sorted(methods))},
    )


class BearerAuth:
    """Who sends a request, from its ``Authorization: Bearer`` token, for one API's ``roles``.

    Both the routes' dependency (:func:`bearer_principal`) and the body gate
    (:class:`kvpool.common.web.body_gate.BodyGate`, which must decide before a body is
    read) ask this one object (:meth:`caller`), so they answer alike, and a connection
    that authenticates is marked so (:func:`kvpool.common.web.connections.trust`).
    """

    def __init__(self, authority: TokenAuthority, *, realm: str, roles: Collection[Role]) -> None:
        self._authority = authority
        self._roles = tuple(roles)
        self._challenge = {"WWW-Authenticate": f'Bearer realm="{realm}"'}
        self._invalid = {"WWW-Authenticate": f'Bearer realm="{realm}", error="invalid_token"'}
        self._allowed = ", ".join(f"{role} tokens" for role in roles)

    def caller(self, scope: Scope) -> Principal:
        """:meth:`principal` of a request's ``Authorization`` header, marking its connection
        authenticated; call it on the event loop, where the connection gate lives."""
        principal = self.principal(Headers(scope=scope).get("authorization"))
        trust(scope)
        return principal

    def principal(self, authorization: str | None) -> Principal:
        """The caller of an ``Authorization`` header value; HTTPException 401 or 403 if none."""
        scheme, token = get_authorization_scheme_param(authorization)
        if not token or scheme.lower() != "bearer":
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED, "a bearer token is required", headers=self._challenge
            )
        principal = self._authority.authenticate(token)
        if principal is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED, "unknown bearer token", headers=self._invalid
            )
        if principal.role not in self._roles:
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"{principal.role} tokens cannot use this API (it takes {self._allowed})",
            )
        return principal


def bearer_principal(auth: BearerAuth, *, description: str) -> Callable[..., Awaitable[Principal]]:
    """A FastAPI dependency: the caller's principal (see :meth:`BearerAuth.caller`); async,
    so that it runs on the event loop (the check is a few hashes)."""
    bearer = HTTPBearer(auto_error=False, description=description)  # declares the scheme

    async def authenticate(
        request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
    ) -> Principal:
        return auth.caller(request.scope)

    return authenticate
