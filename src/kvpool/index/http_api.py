"""The index's HTTP API for gateways: route and lookup, plus health, nodes and metrics.

:func:`create_app` gets every dependency as an argument; the composition root
(:mod:`kvpool.index.server`) builds them.

Access: ``/healthz``, ``/readyz`` and ``/metrics`` need no token; every other
route takes ``Authorization: Bearer <token>`` with a gateway token or an admin
token of the pool (401 without a known token, 403 for a tenant token). A query
names the prompt either by its token ids (with the request's ``cache_salt`` and
the model's fingerprint; the index's configured fingerprint when the request has
none) or by precomputed chunk keys (hex). Errors are ``{"detail": "<reason>"}``.

Handlers are plain ``def``: they take the tracker's lock and hash keys, so
FastAPI runs them in its thread pool, off the event loop. (No postponed
annotations here: FastAPI reads the handlers' annotations, some of them local.)
"""

import time
from collections.abc import Callable
from typing import Annotated, Self

from fastapi import APIRouter, Depends, FastAPI, HTTPException, status
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from kvpool.common.auth import Principal, Role, TokenAuthority
from kvpool.common.config import HttpLimits
from kvpool.common.index_config import Fingerprint
from kvpool.common.keys import KEY_BYTES
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
from kvpool.index.query import NodeMatch, Query
from kvpool.index.service import IndexService
from kvpool.index.subscriber import AgentStatus
from kvpool.index.tracker import NodeCounts

_DESCRIPTION = """\
Cache-aware routing for a kvpool pool: which node holds the longest cached prefix of a
prompt, and where to send it given the nodes' loads. Send `Authorization: Bearer <token>`
(a gateway or admin token); `/healthz`, `/readyz` and `/metrics` need none.
"""

TokenId = Annotated[StrictInt, Field(ge=0, le=2**32 - 1)]
HexKey = Annotated[str, Field(pattern=rf"^[0-9a-f]{{{2 * KEY_BYTES}}}$")]


# ------------------------------------------------------------------ models


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
    event_lag_seconds: float | None = Field(
        description="Receive time minus publish time of the last event."
    )


class Nodes(BaseModel):
    nodes: list[NodeState]


# -------------------------------------------------------------------- app


def create_app(
    service: IndexService,
    authority: TokenAuthority,
    agents: Callable[[], list[AgentStatus]],
    *,
    default_fingerprint: Fingerprint | None = None,
    ready: Callable[[], bool] | None = None,
    metrics: MetricsSource | None = None,
    limits: HttpLimits | None = None,
) -> FastAPI:
    """The HTTP API over ``service``; ``agents`` reports the followed agents (``/v1/nodes``).

    ``limits`` bound request bodies (:class:`~kvpool.common.web.body_gate.BodyGate`).
    """
    app = FastAPI(
        title="kvpool-index",
        summary="Cache-aware routing for vLLM gateways over a kvpool pool.",
        description=_DESCRIPTION,
        version="1",
    )
    app.add_exception_handler(RequestValidationError, on_invalid_request)
    app.add_exception_handler(status.HTTP_405_METHOD_NOT_ALLOWED, on_method_not_allowed)
    auth = BearerAuth(authority, realm="kvpool-index", roles=(Role.GATEWAY, Role.ADMIN))
    app.add_middleware(BodyGate, auth=auth, limits=limits or HttpLimits())
    app.include_router(health_routes(ready or (lambda: True), metrics, what="index"))
    app.include_router(_index_routes(service, auth, agents, default_fingerprint))
    return app


def _index_routes(
    service: IndexService,
    auth: BearerAuth,
    agents: Callable[[], list[AgentStatus]],
    default_fingerprint: Fingerprint | None,
) -> APIRouter:
    caller = bearer_principal(auth, description="A gateway token or an admin token of the pool.")
    Caller = Annotated[Principal, Depends(caller)]
    router = APIRouter(
        prefix="/v1",
        tags=["routing"],
        responses={
            401: {"model": Error, "description": "Missing or unknown bearer token."},
            403: {"model": Error, "description": "A tenant token: tenants cannot route."},
            413: {"model": Error, "description": "Body larger than http_limits.max_body_bytes."},
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
        event_lag_seconds=agent.event_lag,
    )
