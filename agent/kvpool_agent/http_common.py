"""What the agent's and the index's HTTP APIs share: health routes, error bodies, bearer auth.

Both APIs answer errors as ``{"detail": "<reason>"}``, serve ``/healthz``, ``/readyz``
and ``/metrics`` without a token, and take ``Authorization: Bearer <token>`` from the
pool's tokens file (:mod:`kvpool_agent.auth`) everywhere else: a missing or unknown token
is 401, a principal the API does not serve (a gateway on an agent, a tenant on the index)
403.
"""

from collections.abc import Callable, Collection
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

from kvpool_agent.auth import Principal, Role, TokenAuthority

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


def bearer_principal(
    authority: TokenAuthority, *, realm: str, roles: Collection[Role], description: str
) -> Callable[..., Principal]:
    """A FastAPI dependency: the caller's principal, if its role is one of ``roles``."""
    bearer = HTTPBearer(auto_error=False, description=description)
    challenge = {"WWW-Authenticate": f'Bearer realm="{realm}"'}
    invalid = {"WWW-Authenticate": f'Bearer realm="{realm}", error="invalid_token"'}
    allowed = ", ".join(f"{role} tokens" for role in roles)

    def authenticate(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> Principal:
        if credentials is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED, "a bearer token is required", headers=challenge
            )
        principal = authority.authenticate(credentials.credentials)
        if principal is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED, "unknown bearer token", headers=invalid
            )
        if principal.role not in roles:
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"{principal.role} tokens cannot use this API (it takes {allowed})",
            )
        return principal

    return authenticate
