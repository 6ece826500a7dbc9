"""The operator's calls to a pool's agents over their HTTP API, with its admin token.

Answers are parsed with the agent's own response models (``kvpool.agent.edge.http_api``), so
the field names the operator reads are the ones the agents send.

The agents are the pods the pool's DaemonSet selects that have an address; each is called
at ``http://<pod IP>:<spec.ports.http>``, all at once, each call bounded by a timeout, so
that an unreachable node costs seconds, never the operator's loop. An agent that fails is
named in :attr:`Sweep.failed`, with why; the others' answers stand.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import urllib3
from pydantic import BaseModel, ValidationError

from kvpool.common.api_models import Cleared, Pin, Pins, Usage, Warmed
from kvpool.operator.apply import PODS, Cluster
from kvpool.operator.bearer import OperatorToken
from kvpool.operator.render import Pool

CONNECT_SECONDS = 2.0
READ_SECONDS = 10.0
"""Clearing a tenant's L2 objects may take a while; reads of usage are quick."""
MAX_PARALLEL = 16

T = TypeVar("T")
Answer = TypeVar("Answer", bound=BaseModel)


class AgentError(RuntimeError):
    """An agent could not be reached or refused the call."""


@dataclass(frozen=True)
class Sweep(Generic[T]):
    """The answers of a pool's agents to one call."""

    answers: list[T] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    """One line per agent that did not answer: its address and why."""


class Agents:
    def __init__(self, cluster: Cluster, token: OperatorToken) -> None:
        self._cluster = cluster
        self._token = token
        self._http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=CONNECT_SECONDS, read=READ_SECONDS),
            retries=False,
            maxsize=MAX_PARALLEL,
        )

    def usage(self, pool: Pool, port: int, tenant: str) -> Sweep[Usage]:
        return self._sweep(pool, port, _Request("GET", f"/v1/tenants/{tenant}/usage"), Usage)

    def clear(self, pool: Pool, port: int, tenant: str) -> Sweep[Cleared]:
        """Drop the tenant's chunks from every tier of every agent (L1, the node's NVMe
        files, the pool's S3 objects: each agent drops the whole S3 prefix, idempotently)."""
        request = _Request("POST", f"/v1/tenants/{tenant}/clear?tiers=all")
        return self._sweep(pool, port, request, Cleared)

    def pin(self, pool: Pool, port: int, tenant: str, name: str, keys: Sequence[str]) -> Sweep[Pin]:
        """Pin the chunks of ``keys`` (hex, a prompt's head first) under the pin ``name``,
        replacing its keys."""
        request = _Request("PUT", f"/v1/tenants/{tenant}/pins/{name}", {"keys": list(keys)})
        return self._sweep(pool, port, request, Pin)

    def warm(self, pool: Pool, port: int, tenant: str, keys: Sequence[str]) -> Sweep[Warmed]:
        """Load the chunks of ``keys`` (hex, one chain in order) into L1 from the agents' L2
        tiers."""
        request = _Request("POST", f"/v1/tenants/{tenant}/warm", {"keys": list(keys)})
        return self._sweep(pool, port, request, Warmed)

    def unpin(self, pool: Pool, port: int, tenant: str, name: str) -> Sweep[Pins]:
        """Drop the pin ``name``; an agent that has no such pin (404) is done, and is in
        neither the answers nor the failures."""
        request = _Request("DELETE", f"/v1/tenants/{tenant}/pins/{name}", missing_ok=True)
        return self._sweep(pool, port, request, Pins)

    def addresses(self, pool: Pool, port: int) -> list[str]:
        """``host:port`` of every agent of the pool that has an address."""
        pods = self._cluster.select(PODS, pool.namespace, pool.selector())
        ips = [(pod.get("status") or {}).get("podIP") for pod in pods]
        return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips if ip]

    def _sweep(
        self, pool: Pool, port: int, request: _Request, answer: type[Answer]
    ) -> Sweep[Answer]:
        addresses = self.addresses(pool, port)
        sweep: Sweep[Answer] = Sweep()
        if not addresses:
            return sweep
        with ThreadPoolExecutor(min(MAX_PARALLEL, len(addresses))) as threads:
            futures = {
                address: threads.submit(self._call, address, request, answer)
                for address in addresses
            }
        for address, future in futures.items():
            try:
                answered = future.result()
            except AgentError as error:
                sweep.failed.append(f"{address}: {error}")
                continue
            if answered is not None:
                sweep.answers.append(answered)
        return sweep

    def _call(self, address: str, request: _Request, answer: type[Answer]) -> Answer | None:
        """The agent's answer; None for a 404 that the request takes as done."""
        headers = {"Authorization": f"Bearer {self._token.value}", "Accept": "application/json"}
        method, path = request.method, request.path
        try:
            response = self._http.request(
                method, f"http://{address}{path}", headers=headers, json=request.body
            )
        except urllib3.exceptions.HTTPError as error:
            raise AgentError(f"unreachable: {error}") from error
        if request.missing_ok and response.status == 404:
            return None
        if response.status != 200:
            raise AgentError(f"{method} {path} answered {response.status}: {response.data[:200]!r}")
        try:
            return answer.model_validate(json.loads(response.data))
        except (ValueError, ValidationError) as error:
            raise AgentError(f"{method} {path} answered {error}") from error


@dataclass(frozen=True)
class _Request:
    method: str
    path: str
    body: dict[str, Any] | None = None
    missing_ok: bool = False
    """Whether a 404 (nothing there) is as good as done."""
