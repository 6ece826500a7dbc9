"""Shared spaces: their salts, their entries in the pool's ConfigMaps, their pins, their
status. Two sides, sharing the tenants' lock (each writes the pool's tenants ConfigMap):

- a KVCacheTenant's, called by :class:`~kvpool.operator.tenants.TenantReconciler` with the
  lock held: :meth:`SpaceReconciler.handout` (the salts its Secret must hold) and, after its
  entry is written or withdrawn, :meth:`SpaceReconciler.publish` (the spaces' members
  follow);
- the pool's, :meth:`SpaceReconciler.pool_changed`: on every change of the pool and every
  ``--usage-seconds``. It publishes, revokes and clears the spaces removed from the spec,
  keeps the pinned prefixes pinned and warm, reads the usage, writes the status. Agents
  that fail are named in the SharedSpaces condition and retried on the next pass: they
  never stop it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kvpool.common.tenants_configmap import SpaceEntry, TenantEntry, parse_tenants, space_key
from kvpool.operator.agents import Agents
from kvpool.operator.apply import KINDS, ApiError, Cluster
from kvpool.operator.events import PoolEvents
from kvpool.operator.pool_maps import PoolMaps
from kvpool.operator.reasons import CLEAR_INCOMPLETE
from kvpool.operator.render import Pool
from kvpool.operator.spaces.entries import Space, revoked, space_name
from kvpool.operator.spaces.handout import salt_key
from kvpool.operator.spaces.pins import SpacePins
from kvpool.operator.spaces.salts import space_salts
from kvpool.operator.spaces.status import spaces_status
from kvpool.operator.spec import API_VERSION, KIND, InvalidSpec, PoolSpec
from kvpool.operator.status import Problem
from kvpool.operator.usage import usage_summary

log = logging.getLogger(__name__)

POOLS = KINDS[API_VERSION, KIND]


@dataclass(frozen=True)
class Published:
    """What :meth:`SpaceReconciler.publish` wrote."""

    spaces: tuple[Space, ...]
    tenants: Mapping[str, TenantEntry]
    """The pool's accepted tenants, by tenant id."""
    removed: Mapping[str, SpaceEntry]
    """Spaces no longer declared whose entries are still there (revoked), by tenant id."""


class SpaceReconciler:
    def __init__(
        self, cluster: Cluster, agents: Agents, events: PoolEvents, lock: threading.Lock
    ) -> None:
        self._cluster = cluster
        self._agents = agents
        self._events = events
        self._maps = PoolMaps(cluster)
        self._lock = lock

    # ------------------------------------------------- a tenant's side (lock held)

    def handout(self, pool: Pool, spec: PoolSpec, namespace: str) -> dict[str, str]:
        """The salts a tenant of ``namespace`` gets, by their key in its Secret."""
        admitting = [
            space.name for space in spec.shared_spaces if namespace in space.allowed_namespaces
        ]
        if not admitting:
            return {}
        salts = space_salts(self._cluster, pool, [space.name for space in spec.shared_spaces])
        return {salt_key(name): salts[name] for name in admitting}

    def publish(self, pool: Pool, spec: PoolSpec) -> Published:
        """Each declared space's quota and entry (its members: the accepted tenants it
        admits); the entries of spaces no longer declared emptied (their members revoked)."""
        salts = space_salts(self._cluster, pool, [space.name for space in spec.shared_spaces])
        spaces = tuple(Space(declared, salts[declared.name]) for declared in spec.shared_spaces)
        data = self._maps.data(pool, pool.tenants_name)
        if data is None:
            if spaces:
                raise ApiError(f"the pool's ConfigMap {pool.tenants_name} does not exist yet", 404)
            return Published((), {}, {})
        snapshot = parse_tenants(data, f"{pool.namespace}/{pool.tenants_name}")
        for space in spaces:
            self._maps.set_key(pool, pool.quotas_name, space.tenant_id, space.quota())
            value = space.entry(pool, snapshot.tenants).encode()
            self._maps.patch_key(pool, pool.tenants_name, data, space_key(space.tenant_id), value)
        declared = {space.tenant_id for space in spaces}
        removed = {
            tenant: entry for tenant, entry in snapshot.spaces.items() if tenant not in declared
        }
        for tenant, entry in removed.items():
            emptied = revoked(entry).encode()
            self._maps.patch_key(pool, pool.tenants_name, data, space_key(tenant), emptied)
        return Published(spaces, snapshot.tenants, removed)

    # ----------------------------------------------------------- the pool's side

    def refresh(self, body: Mapping[str, Any]) -> None:
        """:meth:`pool_changed` with the pool's spec as it is (a valid one only)."""
        try:
            spec = PoolSpec.parse(body.get("spec") or {})
        except InvalidSpec:
            return  # the pool's reconcile reports it
        self.pool_changed(body, spec)

    def pool_changed(self, body: Mapping[str, Any], spec: PoolSpec) -> None:
        metadata = body["metadata"]
        pool = Pool(metadata["name"], metadata["namespace"], metadata["uid"])
        before = {
            space["name"]: space for space in (body.get("status") or {}).get("sharedSpaces") or ()
        }
        with self._lock:
            published = self.publish(pool, spec)
        if not (published.spaces or published.removed or before):
            return
        problems = self._remove(body, pool, spec, published.removed)
        spaces = []
        for space in published.spaces:
            pins = SpacePins(self._agents, pool, spec, space).keep(
                (before.get(space.name) or {}).get("pinned") or ()
            )
            problems += pins.problems
            members = sorted(space.members(published.tenants).values())
            usage = self._agents.usage(pool, spec.ports.http, space.tenant_id)
            if usage.failed:
                log.warning("usage of the space %s: %s", space.name, "; ".join(usage.failed))
            spaces.append(
                {
                    "name": space.name,
                    "tenantId": space.tenant_id,
                    "members": members,
                    "pinned": pins.held or None,
                    "usage": usage_summary(usage.answers),
                }
            )
            if space.name not in before:
                self._events.space_created(
                    body,
                    f"published the shared space {space.name} (tenant id {space.tenant_id}) "
                    f"with {len(members)} member tenants",
                )
        self._write_status(pool, spaces, problems)

    def _remove(
        self,
        body: Mapping[str, Any],
        pool: Pool,
        spec: PoolSpec,
        removed: Mapping[str, SpaceEntry],
    ) -> list[Problem]:
        """Clear each removed space's chunks on every agent, then drop its quota and entry;
        a space some agents did not clear stays (revoked) for the next pass."""
        problems = []
        for tenant, entry in removed.items():
            name = space_name(entry)
            sweep = self._agents.clear(pool, spec.ports.http, tenant)
            if sweep.failed:
                problems.append(
                    Problem(
                        CLEAR_INCOMPLETE,
                        f"the removed space {name} is revoked but {len(sweep.failed)} agents "
                        f"did not clear its chunks: {'; '.join(sweep.failed)}",
                    )
                )
                continue
            with self._lock:
                self._maps.set_key(pool, pool.quotas_name, tenant, None)
                self._maps.set_key(pool, pool.tenants_name, space_key(tenant), None)
            chunks = sum(answer.dropped_chunks for answer in sweep.answers)
            objects = sum(answer.l2_dropped_objects or 0 for answer in sweep.answers)
            self._events.space_removed(
                body,
                f"removed the shared space {name} (tenant id {tenant}): its members are "
                f"revoked, {chunks} chunks dropped from L1 and {objects} objects from L2 by "
                f"{len(sweep.answers)} agents, its quota dropped",
            )
        return problems

    def _write_status(
        self, pool: Pool, spaces: list[dict[str, Any]], problems: list[Problem]
    ) -> None:
        """The spaces' part of the pool's status, on the pool as stored now (the pool's
        reconcile writes the rest of it, conditions included)."""
        body = self._cluster.get(POOLS, pool.namespace, pool.name)
        if body is None:
            return
        previous = body.get("status") or {}
        generation = int(body["metadata"].get("generation", 1))
        status = spaces_status(previous, generation, spaces, problems, datetime.now(UTC))
        if {key: previous.get(key) for key in status} != status:
            self._cluster.patch_status(POOLS, pool.namespace, pool.name, status)
