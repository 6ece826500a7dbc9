"""Reconciliation: a pool's children follow its spec, its status follows its children.

Two idempotent entry points, each called by a thin kopf handler (``handlers.py``):

- :meth:`Reconciler.pool_changed`: the pool was created or changed, or was found when the
  operator started. Render every child, apply each (server-side apply), write the status,
  post an event naming what changed. An invalid spec is reported (status and a Warning
  event) and not retried; a refused or failed write is reported and raised, so that the
  caller retries.
- :meth:`Reconciler.child_changed`: an event on one of the pool's children. A child that
  was deleted, or no longer holds what the operator renders, is applied again (drift);
  events on the DaemonSet refresh the pool's node counts and conditions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kvpool_operator.apply import KINDS, ApiError, Cluster, kind_of
from kvpool_operator.events import PoolEvents
from kvpool_operator.render import POOL_LABEL, Children, Manifest, Pool, render
from kvpool_operator.spec import API_VERSION, KIND, InvalidSpec, PoolSpec
from kvpool_operator.status import APPLY_FAILED, INVALID_SPEC, Problem, Rollout, pool_status

POOLS = KINDS[API_VERSION, KIND]
DAEMONSETS = KINDS["apps/v1", "DaemonSet"]
SERVICE_MONITORS = KINDS["monitoring.coreos.com/v1", "ServiceMonitor"]


@dataclass(frozen=True)
class Options:
    """Operator-wide settings, from its command line."""

    agent_image: str
    """Image of agents whose pool names none (the operator's own image, by the chart)."""
    retry_seconds: float = 10.0
    """Delay before a pool whose children the API server refused is reconciled again."""


class Reconciler:
    def __init__(self, cluster: Cluster, events: PoolEvents, options: Options) -> None:
        self._cluster = cluster
        self._events = events
        self._options = options

    def pool_changed(self, pool: Mapping[str, Any]) -> None:
        metadata = pool["metadata"]
        generation = int(metadata.get("generation", 1))
        try:
            children = self._render(pool)
        except InvalidSpec as error:
            self._events.invalid_spec(pool, str(error))
            self._write_status(pool, generation, Problem(INVALID_SPEC, str(error)))
            return
        changes: list[str] = []
        try:
            for manifest in children.required():
                change, stored = self._sync(manifest)
                changes += [change] if change else []
                if manifest is children.daemonset:
                    daemonset = stored
            changes += self._sync_monitor(pool, children)
        except ApiError as error:
            self._events.apply_failed(pool, str(error))
            observed = (pool.get("status") or {}).get("observedGeneration")
            self._write_status(pool, observed, Problem(APPLY_FAILED, str(error)))
            raise
        self._write_status(pool, generation, None, daemonset=daemonset)
        if changes:
            self._events.applied(pool, changes)

    def child_changed(self, event_type: str | None, child: Mapping[str, Any]) -> None:
        metadata = child["metadata"]
        pool = self._cluster.get(POOLS, metadata["namespace"], metadata["labels"][POOL_LABEL])
        if pool is None or pool["metadata"].get("deletionTimestamp"):
            return  # the pool is gone; the garbage collector takes its children
        status = pool.get("status") or {}
        if status.get("observedGeneration") != pool["metadata"].get("generation"):
            return  # a spec change is on its way: pool_changed applies it
        try:
            children = self._render(pool)
        except InvalidSpec:
            return  # pool_changed reported it
        desired = next(
            (
                manifest
                for manifest in children.required()
                if (manifest["kind"], manifest["metadata"]["name"])
                == (child["kind"], metadata["name"])
            ),
            None,
        )
        if desired is None:
            return
        deleted = event_type == "DELETED"
        if deleted or not is_subset(desired, child):
            child = self._cluster.apply(desired)
            self._events.drift_corrected(pool, f"{desired['kind']} {metadata['name']}", deleted)
        if desired is children.daemonset:
            self._write_status(
                pool, status.get("observedGeneration"), Problem.recorded(status), daemonset=child
            )

    def _render(self, pool: Mapping[str, Any]) -> Children:
        return render(
            _identity(pool),
            PoolSpec.parse(pool.get("spec") or {}),
            default_image=self._options.agent_image,
        )

    def _sync(self, manifest: Manifest) -> tuple[str | None, Manifest]:
        """Apply one child; says whether that created or changed it."""
        kind, metadata = kind_of(manifest), manifest["metadata"]
        before = self._cluster.get(kind, metadata["namespace"], metadata["name"])
        after = self._cluster.apply(manifest)
        if before is None:
            return f"created {kind.kind} {metadata['name']}", after
        if before["metadata"].get("resourceVersion") != after["metadata"].get("resourceVersion"):
            return f"updated {kind.kind} {metadata['name']}", after
        return None, after

    def _sync_monitor(self, pool: Mapping[str, Any], children: Children) -> list[str]:
        """Make, update or remove the pool's ServiceMonitor, where the cluster has them."""
        if not self._cluster.serves(SERVICE_MONITORS):
            if children.service_monitor is not None:
                self._events.monitor_unavailable(pool)
            return []
        if children.service_monitor is not None:
            change, _ = self._sync(children.service_monitor)
            return [change] if change else []
        namespace, uid = pool["metadata"]["namespace"], pool["metadata"]["uid"]
        name = children.service["metadata"]["name"]
        existing = self._cluster.get(SERVICE_MONITORS, namespace, name)
        owners = (existing or {}).get("metadata", {}).get("ownerReferences", ())
        if any(owner.get("uid") == uid for owner in owners) and self._cluster.delete(
            SERVICE_MONITORS, namespace, name
        ):
            return [f"deleted ServiceMonitor {name}"]
        return []

    def _write_status(
        self,
        pool: Mapping[str, Any],
        observed_generation: int | None,
        problem: Problem | None,
        daemonset: Mapping[str, Any] | None = None,
    ) -> None:
        metadata = pool["metadata"]
        namespace, name = metadata["namespace"], metadata["name"]
        if daemonset is None:
            daemonset = self._cluster.get(DAEMONSETS, namespace, _identity(pool).agent_name) or {}
        previous = pool.get("status") or {}
        status = pool_status(
            generation=int(metadata.get("generation", 1)),
            observed_generation=observed_generation,
            problem=problem,
            rollout=Rollout.of(daemonset),
            previous=previous,
            now=datetime.now(UTC),
        )
        if {key: previous.get(key) for key in status} != status:
            self._cluster.patch_status(POOLS, namespace, name, status)


def _identity(pool: Mapping[str, Any]) -> Pool:
    metadata = pool["metadata"]
    return Pool(metadata["name"], metadata["namespace"], metadata["uid"])


def is_subset(desired: Any, actual: Any) -> bool:
    """Whether ``actual`` holds everything ``desired`` sets (extra fields are someone else's)."""
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and all(
            key in actual and is_subset(value, actual[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(desired)
            and all(is_subset(d, a) for d, a in zip(desired, actual, strict=True))
        )
    return bool(desired == actual)
