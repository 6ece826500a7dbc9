"""Reconciliation: a pool's children follow its spec, its status follows its children.

Two idempotent entry points, each called by a thin kopf handler (``handlers.py``):

- :meth:`Reconciler.pool_changed`: the pool was created or changed, or was found when the
  operator started. Render every child, apply each the pool has (server-side apply), delete
  the optional children it no longer has (those it owns: the index, the ServiceMonitor, the
  NetworkPolicies), write the status, post an event naming what changed. With peers, the
  pool's peer Secret is made (or rotated) before the children, whose agents mount it;
  without, it is deleted after them (:mod:`kvpool.operator.peers`); the same for the
  disaggregation key Secret of a pool whose picker disaggregates
  (:mod:`kvpool.operator.disagg_key`), which its index and decode pods mount. An optional child
  of a kind the cluster does not serve (a ServiceMonitor without prometheus-operator) is
  skipped with a Warning event. An invalid spec is reported (status and a Warning event)
  and not retried; a refused or failed write is reported and raised, so that the caller
  retries.
- :meth:`Reconciler.child_changed`: an event on one of the pool's children. A child that
  was deleted, or no longer holds what the operator renders, is applied again (drift);
  events on the DaemonSet refresh the pool's node counts and conditions, events on the
  index's Deployment its ``status.index``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kvpool.common.names import POOL_LABEL
from kvpool.operator.apply import KINDS, ApiError, Cluster, Kind, kind_of
from kvpool.operator.disagg_key import DisaggregationKey
from kvpool.operator.events import PoolEvents
from kvpool.operator.peers import PeerKeys
from kvpool.operator.reasons import APPLY_FAILED, INVALID_SPEC
from kvpool.operator.render import PICKER_PORT_NAME, ChildRef, Children, Manifest, Pool, render
from kvpool.operator.spec import API_VERSION, KIND, InvalidSpec, PoolSpec
from kvpool.operator.status import (
    IndexReplicas,
    Problem,
    Rollout,
    pool_status,
    written,
)

POOLS = KINDS[API_VERSION, KIND]
DAEMONSETS = KINDS["apps/v1", "DaemonSet"]
DEPLOYMENTS = KINDS["apps/v1", "Deployment"]


@dataclass(frozen=True)
class Options:
    """Operator-wide settings, from its command line."""

    agent_image: str
    """Image of agents whose pool names none (the operator's own image, by the chart)."""
    retry_seconds: float = 10.0
    """Delay before a pool whose children the API server refused is reconciled again (and
    a tenant whose writes failed, or whose deletion some agents did not clear)."""
    usage_seconds: float = 30.0
    """Period of each KVCacheTenant's re-check and usage read, of each pool's shared spaces
    pass and of its peer key rotation check."""
    clear_retries: int = 5
    """Retries of a deleted tenant's clearing while agents fail; then it is deleted anyway."""

    @classmethod
    def of(cls, memo: Mapping[str, Any]) -> Options:
        """The options in kopf's memo (``kvpool.operator.main`` puts them there), which
        the pools' handlers and the webhook's index read."""
        options = memo.get("options")
        if not isinstance(options, cls):
            raise TypeError("the operator's memo needs 'options' (kvpool.operator.main sets them)")
        return options


class Reconciler:
    def __init__(
        self, cluster: Cluster, events: PoolEvents, options: Options, peer_keys: PeerKeys
    ) -> None:
        self._cluster = cluster
        self._events = events
        self._options = options
        self._peer_keys = peer_keys
        self._pd_key = DisaggregationKey(cluster)

    def pool_changed(self, pool: Mapping[str, Any]) -> PoolSpec | None:
        """Reconcile the pool; its spec, or None when it is invalid (reported)."""
        metadata = pool["metadata"]
        generation = int(metadata.get("generation", 1))
        try:
            spec = PoolSpec.parse(pool.get("spec") or {})
            children = self._render(pool, spec)
        except InvalidSpec as error:
            self._events.invalid_spec(pool, str(error))
            self._write_status(pool, generation, Problem(INVALID_SPEC, str(error)), None)
            return None
        try:
            changes, stored = self._sync_pool(pool, spec, children)
        except ApiError as error:
            self._events.apply_failed(pool, str(error))
            observed = (pool.get("status") or {}).get("observedGeneration")
            self._write_status(pool, observed, Problem(APPLY_FAILED, str(error)), children)
            raise
        index = children.index
        self._write_status(
            pool,
            generation,
            None,
            children,
            daemonset=stored[ChildRef.of(children.daemonset)],
            deployment=stored[ChildRef.of(index.deployment)] if index else None,
        )
        if changes:
            self._events.applied(pool, changes)
        return spec

    def child_changed(self, event_type: str | None, child: Mapping[str, Any]) -> None:
        metadata = child["metadata"]
        pool = self._cluster.get(POOLS, metadata["namespace"], metadata["labels"][POOL_LABEL])
        if pool is None or pool["metadata"].get("deletionTimestamp"):
            return  # the pool is gone; the garbage collector takes its children
        status = pool.get("status") or {}
        if status.get("observedGeneration") != pool["metadata"].get("generation"):
            return  # a spec change is on its way: pool_changed applies it
        try:
            children = self._render(pool, PoolSpec.parse(pool.get("spec") or {}))
        except InvalidSpec:
            return  # pool_changed reported it
        ref = ChildRef.of(child)
        desired = next((m for m in children.present() if ChildRef.of(m) == ref), None)
        if desired is None:
            return  # not a child the pool has (one pool_changed deleted, say)
        deleted = event_type == "DELETED"
        if deleted or not is_subset(desired, child):
            child = self._cluster.apply(desired)
            self._events.drift_corrected(pool, f"{desired['kind']} {metadata['name']}", deleted)
        observed, problem = status.get("observedGeneration"), Problem.recorded(status)
        if desired is children.daemonset:
            self._write_status(pool, observed, problem, children, daemonset=child)
        elif children.index is not None and desired is children.index.deployment:
            self._write_status(pool, observed, problem, children, deployment=child)

    def _render(self, pool: Mapping[str, Any], spec: PoolSpec) -> Children:
        return render(_identity(pool), spec, default_image=self._options.agent_image)

    def _sync_pool(
        self, pool: Mapping[str, Any], spec: PoolSpec, children: Children
    ) -> tuple[list[str], dict[ChildRef, Manifest]]:
        """The peer and disaggregation key Secrets before the children that mount them, or
        deleted after those that no longer do; the children."""
        identity, peers, index = _identity(pool), spec.peers, spec.index
        made = self._peer_keys.keep(identity, peers, datetime.now(UTC)) if peers.enabled else []
        if index.disaggregates:
            generation = index.picker.disaggregation.key_generation
            made += self._pd_key.keep(identity, generation)
        changes, stored = self._sync_children(pool, children)
        removed = [] if peers.enabled else self._peer_keys.remove(identity)
        removed += [] if index.disaggregates else self._pd_key.remove(identity)
        return made + changes + removed, stored

    def _sync_children(
        self, pool: Mapping[str, Any], children: Children
    ) -> tuple[list[str], dict[ChildRef, Manifest]]:
        """Apply the children the pool has and delete the optional ones it must not have;
        says what changed, and returns the applied children as stored."""
        changes: list[str] = []
        stored: dict[ChildRef, Manifest] = {}
        served: dict[Kind, bool] = {}
        for manifest in children.present():
            kind, name = kind_of(manifest), manifest["metadata"]["name"]
            missing = self._missing(kind, served)
            if missing is not None:
                self._events.kind_unavailable(pool, kind.kind, name, missing)
                continue
            change, stored[ChildRef.of(manifest)] = self._sync(manifest)
            changes += [change] if change else []
        for ref in children.absent:
            kind = KINDS[ref.api_version, ref.kind]
            if self._missing(kind, served) is None and self._cluster.delete_owned(
                kind, pool["metadata"]["namespace"], ref.name, pool["metadata"]["uid"]
            ):
                changes.append(f"deleted {ref.kind} {ref.name}")
        return changes, stored

    def _missing(self, kind: Kind, served: dict[Kind, bool]) -> str | None:
        """What to install for ``kind`` where the cluster lacks it (asked once per pass, in
        ``served``); None where the cluster serves it."""
        if kind.provided_by is None:
            return None
        if kind not in served:
            served[kind] = self._cluster.serves(kind)
        return None if served[kind] else kind.provided_by

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

    def _write_status(
        self,
        pool: Mapping[str, Any],
        observed_generation: int | None,
        problem: Problem | None,
        children: Children | None,
        *,
        daemonset: Mapping[str, Any] | None = None,
        deployment: Mapping[str, Any] | None = None,
    ) -> None:
        """Write the pool's status from the DaemonSet and the index's Deployment, read here
        unless given. ``children`` None (an invalid spec): whatever index Deployment the pool
        still has."""
        metadata = pool["metadata"]
        namespace, name = metadata["namespace"], metadata["name"]
        identity = _identity(pool)
        if daemonset is None:
            daemonset = self._cluster.get(DAEMONSETS, namespace, identity.agent_name) or {}
        if deployment is None and (children is None or children.index is not None):
            deployment = self._cluster.get(DEPLOYMENTS, namespace, identity.index_name)
        previous = pool.get("status") or {}
        status = pool_status(
            generation=int(metadata.get("generation", 1)),
            observed_generation=observed_generation,
            problem=problem,
            rollout=Rollout.of(daemonset),
            previous=previous,
            now=datetime.now(UTC),
            index=IndexReplicas.of(deployment, PICKER_PORT_NAME)
            if deployment is not None
            else None,
        )
        if not written(status, previous):
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
