"""In-memory stand-ins for the agent and for vLLM's scheduler objects."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvpool.client import (
    AgentError,
    AgentInfo,
    AgentUnavailable,
    PrefetchProgress,
)
from kvpool.common import keys
from kvpool.common.transfer_results import LookupResult, StorePlan
from kvpool.connector.counters import Counters
from kvpool.connector.discovery import AgentAddress
from kvpool.connector.link import AgentLink

CHUNK_BYTES = 4096


@dataclass
class FakeAgent:
    """Keys per tenant; ``down`` makes every call time out."""

    agent_id: str = "agent-1"
    down: bool = False
    refuse: bool = False
    chunks: dict[str, set[bytes]] = field(default_factory=dict)
    l2: dict[str, set[bytes]] = field(default_factory=dict)
    prefetch_polls: int = 1
    """Status polls before a prefetch is done (it then moves its keys from L2 to L1)."""
    prefetches: dict[int, tuple[str, list[bytes], int]] = field(default_factory=dict)
    lookups: list[tuple[str, list[bytes], bool, bool]] = field(default_factory=list)
    """(tenant, keys, lock, count) of every lookup."""
    released: list[int] = field(default_factory=list)
    connects: int = 0
    status_polls: int = 0
    clock: Clock | None = None
    call_seconds: float = 0.0
    """How far each call moves ``clock`` (the agent's answer time)."""
    bound_tenant: str = ""
    """The tenant the connector's token acts for ("": an engine's token, any tenant)."""
    forbidden: set[str] = field(default_factory=set)
    """Tenants whose chunks the connector's token may not touch (lookups are refused)."""
    pushes: list[tuple[str, list[bytes], str, bytes | None]] = field(default_factory=list)
    """(tenant, keys, node, parent) of every push."""

    def put(self, tenant: str, keys: list[bytes]) -> None:
        self.chunks.setdefault(tenant, set()).update(keys)

    def put_l2(self, tenant: str, keys: list[bytes]) -> None:
        self.l2.setdefault(tenant, set()).update(keys)


class FakeClient:
    def __init__(self, agent: FakeAgent, endpoint: str, timeout: float) -> None:
        self.agent = agent
        self.endpoint = endpoint
        self.timeout = timeout
        self.info: AgentInfo | None = None

    def _check(self) -> None:
        if self.agent.clock is not None:
            self.agent.clock.now += self.agent.call_seconds
        if self.agent.down:
            self.info = None
            raise AgentUnavailable(f"no reply from the agent at {self.endpoint}")
        if self.agent.refuse:
            raise AgentError("invalid_request", "refused")

    def connect(self) -> AgentInfo:
        if self.agent.down:
            raise AgentUnavailable("down")
        self.agent.connects += 1
        self.info = AgentInfo(
            self.agent.agent_id,
            1,
            Path("/dev/shm/fake"),
            4096,
            1 << 20,
            4096,
            1 << 20,
            8192,
            self.agent.bound_tenant,
        )
        return self.info

    def lookup(
        self, tenant: str, keys: list[bytes], *, lock: bool = True, count: bool = True
    ) -> LookupResult:
        self._check()
        self.agent.lookups.append((tenant, list(keys), lock, count))
        if tenant in self.agent.forbidden:
            raise AgentError("forbidden", f"this token acts for its tenant only, not {tenant}")
        held = self.agent.chunks.get(tenant, set())
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return LookupResult(7 if lock and count else None, [4096] * count, [CHUNK_BYTES] * count)

    def lookup_prefetch(
        self,
        tenant: str,
        keys: list[bytes],
        parent: bytes | None = None,
        *,
        lock: bool = True,
        count: bool = True,
    ) -> tuple[LookupResult, int]:
        hit = self.lookup(tenant, keys, lock=lock, count=count)
        rest = keys[hit.count :]
        in_l2 = self.agent.l2.get(tenant, set())
        run = 0
        while run < len(rest) and rest[run] in in_l2:
            run += 1
        if not run:
            return hit, 0
        prefetch = len(self.agent.prefetches) + 1
        self.agent.prefetches[prefetch] = (tenant, rest[:run], self.agent.prefetch_polls)
        return hit, prefetch

    def prefetch_status(self, prefetch: int, *, wait_ms: int = 0) -> PrefetchProgress:
        self._check()
        self.agent.status_polls += 1
        tenant, keys, polls = self.agent.prefetches[prefetch]
        if polls > 0:
            self.agent.prefetches[prefetch] = (tenant, keys, polls - 1)
            return PrefetchProgress(False, len(keys), 0)
        self.agent.put(tenant, keys)
        return PrefetchProgress(True, len(keys), len(keys))

    def release(self, lease: int) -> None:
        self._check()
        self.agent.released.append(lease)

    def push(
        self, tenant: str, keys: list[bytes], node: str, parent: bytes | None = None
    ) -> str | None:
        self._check()
        self.agent.pushes.append((tenant, list(keys), node, parent))
        return None

    def prepare_store(
        self, tenant: str, keys: list[bytes], sizes: list[int], parent: bytes | None = None
    ) -> StorePlan:
        self._check()
        return StorePlan(None, [-1] * len(keys), None)

    def close(self) -> None:
        self.info = None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_link(
    agent: FakeAgent,
    counters: Counters | None = None,
    clock: Clock | None = None,
    on_new_agent: Any = None,
) -> AgentLink:
    return AgentLink(
        lambda: AgentAddress("tcp://fake:1", None, None),
        credential=lambda: "fake-token",
        role="test",
        timeout=0.1,
        retry_min_s=1.0,
        retry_max_s=4.0,
        counters=counters or Counters(),
        client_factory=lambda endpoint, token, timeout: FakeClient(agent, endpoint, timeout),
        clock=clock or Clock(),
        on_new_agent=on_new_agent,
    )


@dataclass
class FakeRequest:
    request_id: str
    tokens: list[int]
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_tokens: int | None = None
    """The prompt's length (default: every token is the prompt's)."""

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.tokens) if self.prompt_tokens is None else self.prompt_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens


class FakeBlocks:
    """vLLM's blocks of a request: one list of ids per KV cache group."""

    def __init__(self, *groups: list[int]) -> None:
        self.groups = groups

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.groups


def new_request(req_id: str, *groups: list[int], computed: int) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id, block_ids=groups, num_computed_tokens=computed)


def scheduler_output(
    new: Sequence[SimpleNamespace] = (),
    cached: Sequence[tuple[str, list[int] | None, int]] = (),
    scheduled: dict[str, int] | None = None,
    resumed: set[str] | None = None,
    preempted: set[str] | None = None,
) -> Any:
    """``cached``: (req_id, new block ids or None, num_computed_tokens) per running request."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[req_id for req_id, _, _ in cached],
            resumed_req_ids=resumed or set(),
            new_block_ids=[(ids,) if ids is not None else None for _, ids, _ in cached],
            num_computed_tokens=[computed for _, _, computed in cached],
        ),
        num_scheduled_tokens=scheduled or {},
        preempted_req_ids=preempted or set(),
    )


# Prompts and their chains as the scheduler tests use them.
CHUNK, BLOCK = 256, 128
LAYOUT = "kvpool-chunk-v1;test"


def tokens(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 30000) for _ in range(length)]


def chain(ids: list[int], salt: str | None = None, rank: int = 0, tp: int = 1) -> list[bytes]:
    fingerprint = keys.ModelFingerprint("m", "bfloat16", LAYOUT, rank, tp, CHUNK)
    return keys.chunk_keys(ids, salt, fingerprint)
