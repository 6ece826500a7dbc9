"""The kopf handlers: what triggers a reconciliation. Each only delegates to ``reconcile``.

- a pool is created, changed (spec, labels, annotations) or found at start:
  :meth:`~kvpool_operator.reconcile.Reconciler.pool_changed`, retried while the API
  server refuses;
- any event on a child (labelled ``kvpool.io/pool``; the agents' DaemonSet, the index's
  Deployment and the NetworkPolicies among them): drift correction and the pool's status,
  :meth:`~kvpool_operator.reconcile.Reconciler.child_changed`.

kopf keeps its own bookkeeping in ``kvpool.io/`` annotations of the pool (not in its
status, which is the operator's); of its own log records, only warnings and errors become
Events on the pool, next to those the operator words itself (``events.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from kvpool_agent.names import APP, NAME_LABEL, POOL_LABEL
from kvpool_operator.apply import ApiError, Cluster
from kvpool_operator.events import PoolEvents
from kvpool_operator.reconcile import Options, Reconciler
from kvpool_operator.spec import GROUP, PLURAL, VERSION

registry = kopf.OperatorRegistry()

CHILD_LABELS: Mapping[str, Any] = {
    NAME_LABEL: APP,
    POOL_LABEL: kopf.PRESENT,
}


@kopf.on.login(registry=registry)
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: its service account; elsewhere: the kubeconfig (as ``Cluster.connect``)."""
    return kopf.login_via_client(**kwargs)


@kopf.on.startup(registry=registry)
def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    memo["reconciler"] = Reconciler(Cluster.connect(), PoolEvents(), _options(memo))


@kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
@kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
@kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
def pool_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    try:
        _reconciler(memo).pool_changed(body)
    except ApiError as error:
        raise kopf.TemporaryError(str(error), delay=_options(memo).retry_seconds) from error


@kopf.on.event("v1", "configmaps", labels=CHILD_LABELS, registry=registry)
@kopf.on.event("v1", "services", labels=CHILD_LABELS, registry=registry)
@kopf.on.event("v1", "serviceaccounts", labels=CHILD_LABELS, registry=registry)
@kopf.on.event("apps/v1", "daemonsets", labels=CHILD_LABELS, registry=registry)
@kopf.on.event("apps/v1", "deployments", labels=CHILD_LABELS, registry=registry)
@kopf.on.event("rbac.authorization.k8s.io/v1", "roles", labels=CHILD_LABELS, registry=registry)
@kopf.on.event(
    "rbac.authorization.k8s.io/v1", "rolebindings", labels=CHILD_LABELS, registry=registry
)
@kopf.on.event("networking.k8s.io/v1", "networkpolicies", labels=CHILD_LABELS, registry=registry)
def child_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _reconciler(memo).child_changed(type, body)


def _options(memo: kopf.Memo) -> Options:
    options = memo.get("options")
    if not isinstance(options, Options):
        raise TypeError("the operator's memo needs 'options' (kvpool_operator.main sets them)")
    return options


def _reconciler(memo: kopf.Memo) -> Reconciler:
    reconciler = memo.get("reconciler")
    if not isinstance(reconciler, Reconciler):
        raise TypeError("the operator's memo has no reconciler (the startup handler makes it)")
    return reconciler
