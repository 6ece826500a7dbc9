"""Following the pool's tenants ConfigMap: each version becomes a complete snapshot.

:class:`TenantsWatch` parses each version of the ConfigMap
(:mod:`kvpool.common.tenants_configmap`) into a complete snapshot and hands it to its
listeners (the token authority, through :func:`grants`, and the quota ceilings): a key
that is gone is gone from the next snapshot, so removing a tenant's key revokes its
tokens within a watch event's latency. A deleted or absent ConfigMap is an empty snapshot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kubernetes.config import ConfigException

from kvpool.common.auth import ADMIN, INDEX, Grant, Principal, SpaceAccess
from kvpool.common.kube.watch import ListWatch, Manifest, connect_config_map, watch_config_map
from kvpool.common.tenants_configmap import TenantsSnapshot, parse_tenants

log = logging.getLogger(__name__)

SnapshotListener = Callable[[TenantsSnapshot], None]


class TenantsWatchError(RuntimeError):
    """The tenants ConfigMap cannot be followed (no access to the Kubernetes API)."""


def grants(snapshot: TenantsSnapshot) -> list[Grant]:
    """Every token digest with its principal: the operator's as admin, the index's as an
    index, each tenant's own."""
    found: list[Grant] = [(digest, ADMIN) for digest in snapshot.operator_tokens]
    found.extend((digest, INDEX) for digest in snapshot.index_tokens)
    for tenant, entry in snapshot.tenants.items():
        principal = Principal.for_tenant(tenant)
        found.extend((digest, principal) for digest in entry.tokens)
    return found


def space_access(snapshot: TenantsSnapshot) -> dict[str, SpaceAccess]:
    """Each shared space's members and owners (tenant ids)."""
    return {
        space: SpaceAccess(entry.members, entry.owners) for space, entry in snapshot.spaces.items()
    }


class TenantsWatch:
    """Follows the tenants ConfigMap and tells its listeners each new snapshot."""

    def __init__(self, namespace: str, name: str, config_map: ListWatch) -> None:
        """``config_map``: the list+watch of ConfigMap ``namespace/name`` (not started)."""
        self.where = f"ConfigMap {namespace}/{name}"
        self._name = name
        self._listeners: list[SnapshotListener] = []
        self._last: TenantsSnapshot | None = None
        self._config_map = config_map

    @classmethod
    def connect(cls, reference: str) -> TenantsWatch:
        """ConfigMap ``namespace/name``, through this pod's service account or the kubeconfig."""
        try:
            api, namespace, name = connect_config_map(reference)
            return cls(namespace, name, watch_config_map(api, namespace, name))
        except ConfigException as error:
            raise TenantsWatchError(
                f"no access to the Kubernetes API for ConfigMap {reference}: {error}"
            ) from error

    def add_listener(self, listener: SnapshotListener) -> None:
        """Call ``listener`` (in the watch thread) with each changed snapshot; before start."""
        self._listeners.append(listener)

    def start(self) -> None:
        self._config_map.start(self._publish, thread_name="tenants-watch")

    def stop(self) -> None:
        self._config_map.stop()

    def _publish(self, found: dict[str, Manifest]) -> None:
        config_map = found.get(self._name) or {}
        snapshot = parse_tenants(config_map.get("data") or {}, self.where)
        if snapshot == self._last:
            return
        self._last = snapshot
        log.info(
            "%s: %d tenants, %d operator tokens",
            self.where,
            len(snapshot.tenants),
            len(snapshot.operator_tokens),
        )
        for listener in self._listeners:
            listener(snapshot)
