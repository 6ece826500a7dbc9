"""A shared space's pinned prefixes on the pool's agents: their keys, computed as the
connector computes a structured cache_salt's shared chunks (the space's salt as a plain salt,
for every tensor-parallel rank of the pool's ``spec.index.fingerprint``), and the calls that
keep them pinned (``PUT /v1/tenants/{space}/pins/{name}``, every rank's keys in one list)
and warm (``POST /v1/tenants/{space}/warm``, once per rank) on every agent, or drop a pin
no longer declared (``DELETE``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.common.api_models import MAX_REQUEST_KEYS
from kvpool.common.keys import ModelFingerprint, chunk_keys
from kvpool.operator.agents import Agents, Sweep
from kvpool.operator.reasons import PINS_INCOMPLETE, PINS_NEED_FINGERPRINT
from kvpool.operator.render import Pool
from kvpool.operator.spaces.entries import Space
from kvpool.operator.spec import FingerprintSpec, PinnedPrefix, PoolSpec
from kvpool.operator.status import Problem


def rank_chains(
    tokens: Sequence[int], salt: str, fingerprint: FingerprintSpec, chunk_tokens: int
) -> list[list[str]]:
    """The keys (hex) of the full chunks of ``tokens`` under the space's ``salt``, one chain
    per rank ``0..tpSize-1`` (the fingerprint's ``tpRank`` is the index's, not the pins')."""
    size = fingerprint.chunk_tokens or chunk_tokens
    return [
        [
            key.hex()
            for key in chunk_keys(
                list(tokens),
                salt,
                ModelFingerprint(
                    fingerprint.model,
                    fingerprint.dtype,
                    fingerprint.kv_layout,
                    rank,
                    fingerprint.tp_size,
                    size,
                ),
            )
        ]
        for rank in range(fingerprint.tp_size)
    ]


def pin_keys(chains: Sequence[Sequence[str]]) -> list[str]:
    """Every rank's keys in one list, chunk by chunk (every rank's first chunk, then every
    rank's second...): an agent whose pin budget cannot hold them all holds the first ones,
    and so the same head of the prefix for every rank."""
    return [key for chunk in zip(*chains, strict=True) for key in chunk]


@dataclass
class Pinned:
    """What one pass did with a space's pins."""

    held: list[str] = field(default_factory=list)
    """The pins the operator holds for the space: those declared, and those removed from the
    spec that some agent may still have (dropped again on the next pass)."""
    problems: list[Problem] = field(default_factory=list)


class SpacePins:
    """One pass over a space's pins on the pool's agents."""

    def __init__(self, agents: Agents, pool: Pool, spec: PoolSpec, space: Space) -> None:
        self._agents = agents
        self._pool = pool
        self._spec = spec
        self._space = space
        self._outcome = Pinned()

    def keep(self, held: Sequence[str]) -> Pinned:
        """Pin (and warm) every declared prefix on every agent, and drop the pins of ``held``
        (the previous pass's) that are no longer declared."""
        fingerprint, space = self._spec.index.fingerprint, self._space
        declared = {pin.name: pin for pin in space.spec.pinned}
        if fingerprint is not None:
            for pin in declared.values():
                self._pin(pin, fingerprint)
        elif declared:
            self._problem(
                PINS_NEED_FINGERPRINT,
                f"the space {space.name} has pinned prefixes but the pool has no "
                "spec.index.fingerprint to key them with: none is pinned",
            )
        for name in held:
            if name not in declared:
                self._unpin(name)
            elif fingerprint is None:
                self._outcome.held.append(name)  # pinned with keys it cannot compute now
        self._outcome.held.sort()
        return self._outcome

    def _pin(self, pin: PinnedPrefix, fingerprint: FingerprintSpec) -> None:
        """Pin one prefix on every agent, then warm it (a chain per rank: warming stops at
        the first chunk no tier holds)."""
        where, space = f"{pin.name} of the space {self._space.name}", self._space
        chains = rank_chains(pin.tokens, space.salt, fingerprint, self._spec.chunk_tokens)
        keys = pin_keys(chains)
        if not keys or len(keys) > MAX_REQUEST_KEYS:
            size = fingerprint.chunk_tokens or self._spec.chunk_tokens
            self._problem(
                PINS_INCOMPLETE,
                f"the pin {where} pins nothing: its {len(pin.tokens)} tokens hold no full "
                f"chunk of {size}"
                if not keys
                else f"the pin {where} names {len(keys)} keys ({len(chains)} ranks), more "
                f"than an agent takes ({MAX_REQUEST_KEYS}): shorten it",
            )
            return
        self._outcome.held.append(pin.name)
        port, pool, tenant = self._spec.ports.http, self._pool, space.tenant_id
        self._report(f"pinning {where}", self._agents.pin(pool, port, tenant, pin.name, keys))
        for rank, chain in enumerate(chains if pin.warm else ()):
            warmed = self._agents.warm(pool, port, tenant, chain)
            self._report(f"warming {where} (rank {rank})", warmed)

    def _unpin(self, name: str) -> None:
        space = self._space
        dropped = self._agents.unpin(self._pool, self._spec.ports.http, space.tenant_id, name)
        if not self._report(f"dropping the pin {name} of the space {space.name}", dropped):
            self._outcome.held.append(name)

    def _report(self, what: str, sweep: Sweep[Any]) -> bool:
        """Whether every agent did ``what``; a problem naming those that failed if not."""
        if sweep.failed:
            failures = "; ".join(sweep.failed)
            self._problem(
                PINS_INCOMPLETE, f"{what} failed on {len(sweep.failed)} agents: {failures}"
            )
        return not sweep.failed

    def _problem(self, reason: str, message: str) -> None:
        self._outcome.problems.append(Problem(reason, message))
