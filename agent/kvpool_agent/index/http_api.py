"""The index's HTTP API for gateways: route and lookup, plus health, nodes and metrics.

:func:`create_app` gets every dependency as an argument; the composition root
(:mod:`kvpool_agent.index.server`) builds them.

Access: ``/healthz``, ``/readyz`` and ``/metrics`` need no token; every other
route takes ``Authorization: Bearer <token>`` with a gateway token or an admin
token of the pool (401 otherwise). A query names the prompt either by its
token ids (with the request's ``cache_salt`` and the model's fingerprint; the
index's configured fingerprint when the request has none) or by precomputed
chunk keys (hex). Errors are ``{"detail": "<reason>"}``.

Handlers are plain ``def``: they take the tracker's lock and hash keys, so
FastAPI runs them in its thread pool, off the event loop. (No postponed
annotations here: FastAPI reads the handlers' annotations, some of them local.)
"""

import time
from collections.abc import Callable
from typing import Annotated, Self

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from kvpool_agent.index.auth import GatewayAuthority, Role
from kvpool_agent.index.config import Fingerprint
from kvpool_agent.index.query import NodeMatch, Query
from kvpool_agent.index.service import IndexService
from kvpool_agent.index.subscriber import AgentStatus
from kvpool_agent.index.tracker import NodeCounts
from kvpool_agent.keys import KEY_BYTES

MetricsSource = Callable[[], tuple[bytes, str]]
"""Renders the metrics exposition: ``(body, content_type)``."""

_DESCRIPTION = """\
Cache-aware routing for a kvpool pool: which node holds the longest cached prefix of a
prompt, and where to send it given the nodes' loads. Send `Authorization: Bearer <token>`
(a gateway or admin token); `/healthz`, `/readyz` and `/metrics` need none.
"""
_BEARER = {"WWW-Authenticate": 'Bearer realm="kvpool-index"'}
_INVALID_TOKEN = {"WWW-Authenticate": 'Bearer realm="kvpool-index", error="invalid_token"'}

TokenId = Annotated[StrictInt, Field(ge=0, le=2**32 - 1)]
HexKey = Annotated[str, Field(pattern=rf"^[0-9a-f]{{{2 * KEY_BYTES}}}$")]


# ------------------------------------------------------------------ models


class Error(BaseModel):
    detail: str = Field(description="Why the request failed.")


class Health(BaseModel):
    status: str = Field("ok", description="Always 'ok' while the process serves requests.")


class Readiness(BaseModel):
    ready: bool = Field(description="True once the index follows the pool's agents.")


class LookupRequest(BaseModel):
    """A prompt: ``token_ids`` (with ``cache_salt`` and a fingerprint) or ``chunk_keys``."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[TokenId] | None = Field(None, description="The prompt's token ids.")
    cache_salt: str | None = Field(
        None, description="The request's vLLM cache_salt (none: the default tenant)."
    )
    fingerprint: Fingerprint | None = Field(
        None, description="The model's key fingerprint; default: the index's configured one."
    )
    chunk_keys: list[HexKey] | None = Field(
        None, description="Precomputed chunk keys (64 hex characters each), instead of tokens."
    )
    chunk_tokens: int | None = Field(
        None, ge=1, description="Tokens per chunk of chunk_keys; default: the fingerprint's."
    )

    @model_validator(mode="after")
    def _one_prompt(self) -> Self:
        if (self.token_ids is None) == (self.chunk_keys is None):
            raise ValueError("give exactly one of token_ids and chunk_keys")
        if self.chunk_keys is not None and self.cache_salt is not None:
            raise ValueError("chunk_keys are salted already: leave cache_salt out")
        return self


class LookupBody(LookupRequest):
    nodes: list[str] | None = Field(None, description="Answer for these nodes only.")


class RouteBody(LookupRequest):
    loads: dict[str, Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(
        min_length=1,
        description="Candidate nodes and their load (e.g. requests queued and running).",
    )


class Match(BaseModel):
    node: str = Field(description="Node name.")
    chunks: int = Field(description="Leading chunks of the prompt cached on the node.")
    tokens: int = Field(description="The same in tokens.")
    last_seen: float = Field(description="Unix time the last matched chunk was seen stored.")

    @classmethod
    def of(cls, match: NodeMatch) -> Self:
        return cls(
            node=match.node, chunks=match.chunks, tokens=match.tokens, last_seen=match.last_seen
        )


class Lookup(BaseModel):
    prompt_tokens: int = Field(description="Tokens in the prompt.")
    chunk_tokens: int = Field(description="Tokens per chunk.")
    matches: list[Match] = Field(description="Nodes holding a prefix, longest first.")


class RouteAnswer(BaseModel):
    node: str = Field(description="Where to send the request: one of the candidates.")
    reason: str = Field(description="longest_match, overloaded or low_match.")
    matched_tokens: int = Field(description="Cached prefix on the chosen node, in tokens.")
    prompt_tokens: int = Field(description="Tokens in the prompt.")
    matches: list[Match] = Field(description="Candidates holding a prefix, longest first.")


class NodeState(BaseModel):
    node: str
    chunks: int = Field(description="Chunks tracked for the node.")
    agent_id: str | None = Field(description="Id of the agent process the index follows.")
    synced: bool = Field(description="The node's keys are a snapshot plus every later event.")
    connected: bool = Field(description="The index is connected to the agent's event socket.")
    events: int = Field(description="Chunk events applied.")
    resyncs: dict[str, int] = Field(description="Resynchronisations by reason.")
    last_event_age_seconds: float | None = Field(description="Seconds since the last event.")


class Nodes(BaseModel):
    nodes: list[NodeState]


# -------------------------------------------------------------------- app


def create_app(
    service: IndexService,
    authority: GatewayAuthority,
    agents: Callable[[], list[AgentStatus]],
    *,
    default_fingerprint: Fingerprint | None = None,
    ready: Callable[[], bool] | None = None,
    metrics: MetricsSource | None = None,
) -> FastAPI:
    """The HTTP API over ``service``; ``agents`` reports the followed agents (``/v1/nodes``)."""
    app = FastAPI(
        title="kvpool index",
        summary="Cache-aware routing for vLLM gateways over a kvpool pool.",
        description=_DESCRIPTION,
        version="1",
    )
    app.add_exception_handler(RequestValidationError, _on_invalid_request)
    app.include_router(_health_routes(ready or (lambda: True), metrics))
    app.include_router(_index_routes(service, authority, agents, default_fingerprint))
    return app


async def _on_invalid_request(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item.get("loc", ()))
        message = str(item.get("msg", "invalid"))
        problems.append(f"{where}: {message}" if where else message)
    return JSONResponse({"detail": "invalid request: " + "; ".join(problems)}, status_code=422)


def _health_routes(ready: Callable[[], bool], metrics: MetricsSource | None) -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/healthz", summary="Liveness: 200 while the process is up.")
    async def healthz() -> Health:
        return Health()

    @router.get(
        "/readyz",
        summary="Readiness: 200 once the index follows the pool's agents, else 503.",
        responses={503: {"model": Error, "description": "Starting or stopping."}},
    )
    def readyz() -> Readiness:
        if not ready():
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "the index is not ready")
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


def _index_routes(
    service: IndexService,
    authority: GatewayAuthority,
    agents: Callable[[], list[AgentStatus]],
    default_fingerprint: Fingerprint | None,
) -> APIRouter:
    bearer = HTTPBearer(auto_error=False, description="A gateway token or an admin token.")

    def caller(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> Role:
        if credentials is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED, "a bearer token is required", headers=_BEARER
            )
        role = authority.authenticate(credentials.credentials)
        if role is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "unknown bearer token (the index takes gateway and admin tokens)",
                headers=_INVALID_TOKEN,
            )
        return role

    Caller = Annotated[Role, Depends(caller)]
    router = APIRouter(
        prefix="/v1",
        tags=["routing"],
        responses={
            401: {"model": Error, "description": "Missing or unknown bearer token."},
            422: {"model": Error, "description": "Malformed request."},
        },
    )

    def query_of(request: LookupRequest) -> Query:
        fingerprint = request.fingerprint or default_fingerprint
        if request.chunk_keys is not None:
            chunk_tokens = request.chunk_tokens or (fingerprint.chunk_tokens if fingerprint else 0)
            if not chunk_tokens:
                raise HTTPException(
                    status.HTTP_422_UNPROCESSABLE_CONTENT,
                    "chunk_keys need chunk_tokens (or a fingerprint)",
                )
            return Query.of_keys([bytes.fromhex(key) for key in request.chunk_keys], chunk_tokens)
        assert request.token_ids is not None
        if fingerprint is None:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                "token_ids need a fingerprint: the index has no default one configured",
            )
        return Query.of_tokens(request.token_ids, request.cache_salt, fingerprint.fingerprint())

    @router.post("/lookup", summary="Nodes holding a prefix of the prompt, longest first.")
    def lookup(_: Caller, body: LookupBody) -> Lookup:
        query = query_of(body)
        matches = service.lookup(query, body.nodes)
        return Lookup(
            prompt_tokens=query.prompt_tokens,
            chunk_tokens=query.chunk_tokens,
            matches=[Match.of(match) for match in matches],
        )

    @router.post("/route", summary="The candidate node to send the prompt to.")
    def route(_: Caller, body: RouteBody) -> RouteAnswer:
        query = query_of(body)
        answer = service.route(query, body.loads)
        decision = answer.decision
        return RouteAnswer(
            node=decision.node,
            reason=decision.reason.value,
            matched_tokens=decision.matched_tokens,
            prompt_tokens=query.prompt_tokens,
            matches=[Match.of(match) for match in answer.matches],
        )

    @router.get("/nodes", summary="The agents the index follows, and their state.")
    def nodes(_: Caller) -> Nodes:
        counts = service.tracker.counts()
        now = time.time()
        return Nodes(
            nodes=[
                _node_state(agent, counts.get(agent.endpoint.node), now)
                for agent in sorted(agents(), key=lambda status: status.endpoint.node)
            ]
        )

    return router


def _node_state(agent: AgentStatus, counts: NodeCounts | None, now: float) -> NodeState:
    age = None if agent.last_event is None else max(0.0, now - agent.last_event)
    return NodeState(
        node=agent.endpoint.node,
        chunks=0 if counts is None else counts.chunks,
        agent_id=agent.agent_id,
        synced=agent.synced,
        connected=agent.connected,
        events=agent.events,
        resyncs=agent.resyncs,
        last_event_age_seconds=age,
    )
