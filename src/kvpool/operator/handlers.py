"""The kopf handlers: what triggers a reconciliation. Each only delegates to ``reconcile``.

- a pool is created, changed (spec, labels, annotations) or found at start:
  :meth:`~kvpool.operator.reconcile.Reconciler.pool_changed`, retried while the API
  server refuses;
- any event on a child (labelled ``kvpool.io/pool``; the agents' DaemonSet, the index's
  Deployment and the NetworkPolicies among them): drift correction and the pool's status,
  :meth:`~kvpool.operator.reconcile.Reconciler.child_changed`;
- after each pool's reconcile, and every ``--usage-seconds`` (a daemon per pool that has
  shared spaces): its shared spaces (:mod:`kvpool.operator.spaces`: published, removed ones
  cleared, pins kept, usage read);
- every ``--usage-seconds`` (a daemon per pool with peers): its peer keys, rotated when due
  (:mod:`kvpool.operator.peers`; the reconcile makes the Secret and deletes it). The pools
  with a daemon carry kopf's finalizer, which stops it on deletion;
- a KVCacheTenant is created, changed or found at start, or its pool has an event (created,
  changed, deleted), or every ``--usage-seconds`` (a daemon per tenant: admission again,
  then its usage): :mod:`kvpool.operator.tenants`; its deletion (kopf's finalizer,
  ``kvpool.io/finalizer``, holds it until the token is revoked and its chunks cleared,
  retried ``--clear-retries`` times while agents fail).

The operator's own admin token (:class:`~kvpool.operator.bearer.OperatorToken`) is made at
start, kept in the memo only, and its digest published in every pool's tenants ConfigMap.

kopf keeps its own bookkeeping in ``kvpool.io/`` annotations of the pool (not in its
status, which is the operator's); of its own log records, only warnings and errors become
Events on the pool, next to those the operator words itself (``events.py``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import kopf

from kvpool.common.names import APP, NAME_LABEL, POOL_LABEL
from kvpool.operator.agents import Agents
from kvpool.operator.apply import ApiError, Cluster
from kvpool.operator.bearer import OperatorToken
from kvpool.operator.daemons import every
from kvpool.operator.events import PoolEvents, TenantEvents
from kvpool.operator.peers import PeerKeys
from kvpool.operator.reasons import SHARED_SPACES
from kvpool.operator.reconcile import Options, Reconciler
from kvpool.operator.render import Pool
from kvpool.operator.spaces import SpaceReconciler
from kvpool.operator.spec import GROUP, PLURAL, TENANT_PLURAL, VERSION, InvalidSpec, PoolSpec
from kvpool.operator.tenants import AgentsUnreachable, TenantReconciler

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
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.posting.level = logging.WARNING
    cluster, token, lock = Cluster.connect(), OperatorToken(), threading.Lock()
    agents = Agents(cluster, token)
    memo["peer_keys"] = peer_keys = PeerKeys(cluster, PoolEvents())
    memo["reconciler"] = Reconciler(cluster, PoolEvents(), Options.of(memo), peer_keys)
    memo["spaces"] = spaces = SpaceReconciler(cluster, agents, PoolEvents(), lock)
    memo["tenants"] = TenantReconciler(
        cluster, TenantEvents(), agents, token, spaces=spaces, lock=lock
    )


@kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
@kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
@kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
def pool_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    with _retried(memo, ApiError):
        spec = _reconciler(memo).pool_changed(body)
        metadata = body["metadata"]
        pool = Pool(metadata["name"], metadata["namespace"], metadata["uid"])
        _tenants(memo).publish_pool_tokens(pool, index=spec is not None and spec.index.enabled)
        if spec is not None:
            _spaces(memo).pool_changed(body, spec)


def _has_spaces(spec: kopf.Spec, status: kopf.Status, **_: Any) -> bool:
    """Whether a pool declares shared spaces or still has some (removed, not cleared yet):
    only such pools have a daemon, and so kopf's finalizer (it stops the daemon on deletion)."""
    return bool(spec.get("sharedSpaces") or status.get("sharedSpaces")) or any(
        condition.get("type") == SHARED_SPACES for condition in status.get("conditions") or ()
    )


@kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, cancellation_timeout=5.0, when=_has_spaces)
async def pool_spaces(
    stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    """Every ``--usage-seconds``: the pool's shared spaces again (pins on agents that came or
    restarted, removed spaces that some agent did not clear yet, usage). Async, as
    :func:`tenant_usage`."""
    spaces = _spaces(memo)
    await every(stopped, Options.of(memo).usage_seconds, lambda: _refresh_spaces(spaces, body))


def _refresh_spaces(spaces: SpaceReconciler, body: kopf.Body) -> None:
    try:
        spaces.refresh(body)
    except ApiError as error:
        logging.getLogger(__name__).warning("shared spaces not refreshed: %s", error)


def _has_peers(spec: kopf.Spec, **_: Any) -> bool:
    """Whether a pool's agents are peers (a pool with an invalid spec has no daemon: its
    reconcile reports the spec, and its keys stay as they are)."""
    try:
        return PoolSpec.parse(spec).peers.enabled
    except InvalidSpec:
        return False


@kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, cancellation_timeout=5.0, when=_has_peers)
async def pool_peer_keys(
    stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    """Every ``--usage-seconds``: a key added to the pool's peer Secret when the newest is
    ``spec.peers.credentialRotation`` old, the oldest dropped. Async, as
    :func:`tenant_usage`."""
    keys = _peer_keys(memo)
    await every(stopped, Options.of(memo).usage_seconds, lambda: _rotate_peer_keys(keys, body))


def _rotate_peer_keys(keys: PeerKeys, body: kopf.Body) -> None:
    try:
        keys.refresh(body)
    except ApiError as error:
        logging.getLogger(__name__).warning("peer keys not rotated: %s", error)


@kopf.index(GROUP, VERSION, TENANT_PLURAL, registry=registry)
def tenants_by_pool(
    namespace: str | None, name: str, spec: kopf.Spec, **_: Any
) -> dict[tuple[str, str], tuple[str | None, str]]:
    """(pool namespace, pool name) -> (namespace, name) of each tenant bound to it."""
    ref = spec.get("poolRef") or {}
    return {(str(ref.get("namespace")), str(ref.get("name"))): (namespace, name)}


@kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
def pool_seen(namespace: str | None, name: str, memo: kopf.Memo, **kwargs: Any) -> None:
    """A pool's event (a deletion among them): its tenants follow (kopf passes the index
    ``tenants_by_pool`` by its name)."""
    index: kopf.Index[tuple[str, str], tuple[str, str]] = kwargs["tenants_by_pool"]
    # a copy: kopf updates the index from other handlers' threads meanwhile
    for tenant_namespace, tenant_name in list(index.get((str(namespace), name), ())):
        try:
            _tenants(memo).refresh(tenant_namespace, tenant_name)
        except ApiError as error:
            logging.getLogger(__name__).warning(
                "tenant %s/%s not refreshed: %s", tenant_namespace, tenant_name, error
            )


@kopf.on.resume(GROUP, VERSION, TENANT_PLURAL, registry=registry)
@kopf.on.create(GROUP, VERSION, TENANT_PLURAL, registry=registry)
@kopf.on.update(GROUP, VERSION, TENANT_PLURAL, registry=registry)
def tenant_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    with _retried(memo, ApiError):
        _tenants(memo).tenant_changed(body)


@kopf.on.delete(GROUP, VERSION, TENANT_PLURAL, registry=registry)
def tenant_deleted(body: kopf.Body, retry: int, memo: kopf.Memo, **_: Any) -> None:
    last_attempt = retry >= Options.of(memo).clear_retries
    with _retried(memo, ApiError, AgentsUnreachable):
        _tenants(memo).tenant_deleted(body, last_attempt=last_attempt)


@kopf.daemon(GROUP, VERSION, TENANT_PLURAL, registry=registry, cancellation_timeout=5.0)
async def tenant_usage(
    stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    """Every ``--usage-seconds``: admission again (a namespace relabelled, a pool's limits
    changed), then the tenant's usage from the agents. Async, so that waiting holds no
    thread (a sync daemon per tenant would hold one of kopf's few threads each, and starve
    the handlers); each pass runs in a thread for as long as it takes."""
    tenants = _tenants(memo)
    await every(stopped, Options.of(memo).usage_seconds, lambda: _recheck(tenants, body))


def _recheck(tenants: TenantReconciler, body: kopf.Body) -> None:
    try:
        tenants.recheck(str(body.metadata.namespace), str(body.metadata.name))
    except ApiError as error:
        logging.getLogger(__name__).warning("tenant not re-checked: %s", error)


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


@contextlib.contextmanager
def _retried(memo: kopf.Memo, *errors: type[Exception]) -> Iterator[None]:
    """What ``errors`` stop (the API server refusing, agents not answering) is retried after
    ``--retry-seconds``."""
    try:
        yield
    except errors as error:
        raise kopf.TemporaryError(str(error), delay=Options.of(memo).retry_seconds) from error


def _spaces(memo: kopf.Memo) -> SpaceReconciler:
    spaces = memo.get("spaces")
    if not isinstance(spaces, SpaceReconciler):
        raise TypeError("the operator's memo has no space reconciler (the startup handler)")
    return spaces


def _peer_keys(memo: kopf.Memo) -> PeerKeys:
    keys = memo.get("peer_keys")
    if not isinstance(keys, PeerKeys):
        raise TypeError("the operator's memo has no peer keys (the startup handler)")
    return keys


def _tenants(memo: kopf.Memo) -> TenantReconciler:
    tenants = memo.get("tenants")
    if not isinstance(tenants, TenantReconciler):
        raise TypeError("the operator's memo has no tenant reconciler (the startup handler)")
    return tenants


def _reconciler(memo: kopf.Memo) -> Reconciler:
    reconciler = memo.get("reconciler")
    if not isinstance(reconciler, Reconciler):
        raise TypeError("the operator's memo has no reconciler (the startup handler makes it)")
    return reconciler
