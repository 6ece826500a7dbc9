"""Tenant quotas in the pool's quota ConfigMap, through the Kubernetes API.

The ConfigMap (``kvpool-<pool>-quotas``, made by the operator with the pool) maps tenant
ids to limits: bytes as a decimal string, or ``unlimited`` (both tiers alike), or JSON
``{"l1": <bytes or null>, "nvme": <bytes or null>}`` (null: unlimited). Every agent of the
pool uses it:

- a quota set or reverted through any agent's HTTP API is one JSON merge patch of one key
  (:meth:`KubernetesQuotaStore.save`, :meth:`~KubernetesQuotaStore.delete`), so writers
  through different agents never overwrite each other's tenants;
- :meth:`~KubernetesQuotaStore.start` lists and then watches the ConfigMap in a thread of
  its own and calls ``on_change`` with the complete quotas whenever they change, so every
  agent applies a quota within a watch event's latency of its write. Events arrive in the
  order of the writes; applying each complete mapping in that order converges every agent
  on the ConfigMap's content.

When the API server cannot be reached, :meth:`~KubernetesQuotaStore.load` answers with the
last quotas the store saw and the watch retries in the background; writes fail with
:class:`~kvpool.agent.tenancy.quota_store.QuotaStoreError` (the HTTP API answers 503) rather than
let one agent diverge from the others. A value of none of these forms (a hand edit) is
logged and ignored; the other tenants still apply.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

import urllib3
from kubernetes.client import CoreV1Api
from kubernetes.client.exceptions import ApiException
from kubernetes.config import ConfigException

from kvpool.agent.tenancy.quota_store import QuotaStoreError
from kvpool.common.kube.watch import Manifest, connect_config_map, watch_config_map
from kvpool.common.quotas import Quota, quota_from_configmap, quota_to_configmap

log = logging.getLogger(__name__)

FIELD_MANAGER = "kvpool-agent"

QuotaListener = Callable[[dict[str, Quota]], None]
"""Receives the complete quotas, each time they change."""


class KubernetesQuotaStore:
    """A :class:`~kvpool.agent.tenancy.quota_store.QuotaStore` on one ConfigMap, with a watch."""

    def __init__(
        self,
        api: CoreV1Api,
        namespace: str,
        name: str,
        *,
        timeout: float = 10.0,
        retry_seconds: float = 2.0,
        watch_seconds: int = 300,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self._api = api
        self._timeout = timeout
        self._lock = threading.Lock()
        self._known: dict[str, Quota] | None = None
        self._published: dict[str, Quota] | None = None
        self._config_map = watch_config_map(
            api,
            namespace,
            name,
            timeout=timeout,
            retry_seconds=retry_seconds,
            watch_seconds=watch_seconds,
        )

    @classmethod
    def connect(cls, reference: str) -> KubernetesQuotaStore:
        """The ConfigMap ``namespace/name``, through this pod's service account (in a pod) or
        the kubeconfig (``$KUBECONFIG``, elsewhere); QuotaStoreError if neither is there."""
        try:
            api, namespace, name = connect_config_map(reference)
        except ConfigException as error:
            raise QuotaStoreError(
                f"no access to the Kubernetes API for ConfigMap {reference}: {error}"
            ) from error
        return cls(api, namespace, name)

    @property
    def where(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name}"

    def load(self) -> dict[str, Quota]:
        """The quotas now, or the last known ones while the API server is unreachable."""
        try:
            config_map = self._api.read_namespaced_config_map(
                self.name, self.namespace, _request_timeout=self._timeout
            )
        except ApiException as error:
            if error.status == 404:
                return self._remember({}, published=True)
            return self._last_known(error)
        except urllib3.exceptions.HTTPError as error:
            return self._last_known(error)
        return self._remember(self._parse(config_map.data or {}), published=True)

    def save(self, tenant: str, limits: Quota) -> None:
        self._patch({tenant: quota_to_configmap(limits)})

    def delete(self, tenant: str) -> None:
        self._patch({tenant: None})

    def start(self, on_change: QuotaListener) -> None:
        """Watch the ConfigMap; ``on_change`` runs in the watch thread."""
        self._config_map.start(
            lambda found: self._publish(found.get(self.name), on_change), thread_name="quota-watch"
        )

    def stop(self) -> None:
        self._config_map.stop()

    def _patch(self, data: dict[str, str | None]) -> None:
        try:
            config_map = self._api.patch_namespaced_config_map(
                self.name,
                self.namespace,
                {"data": data},
                field_manager=FIELD_MANAGER,
                _content_type="application/merge-patch+json",
                _request_timeout=self._timeout,
            )
        except ApiException as error:
            if error.status == 404:
                raise QuotaStoreError(
                    f"{self.where} does not exist (the operator makes it with the pool)"
                ) from error
            raise QuotaStoreError(
                f"cannot write quotas to {self.where}: {error.status} {error.reason}"
            ) from error
        except urllib3.exceptions.HTTPError as error:
            raise QuotaStoreError(
                f"cannot write quotas to {self.where}: the API server is unreachable ({error})"
            ) from error
        self._remember(self._parse(config_map.data or {}), published=False)

    def _last_known(self, error: Exception) -> dict[str, Quota]:
        with self._lock:
            known = self._known
        if known is None:
            raise QuotaStoreError(f"cannot read quotas from {self.where}: {error}") from error
        log.warning("cannot read quotas from %s (%s); using the last known ones", self.where, error)
        return dict(known)

    def _remember(self, limits: dict[str, Quota], *, published: bool) -> dict[str, Quota]:
        """Keep ``limits`` as the last known quotas (and as applied, if the caller applies)."""
        with self._lock:
            self._known = limits
            if published:
                self._published = limits
        return dict(limits)

    def _parse(self, data: Mapping[str, str]) -> dict[str, Quota]:
        limits: dict[str, Quota] = {}
        for tenant, value in data.items():
            try:
                limits[tenant] = quota_from_configmap(value)
            except ValueError as error:
                log.error(
                    "%s: the quota of tenant %s is %r, %s; ignored",
                    self.where,
                    tenant,
                    value,
                    error,
                )
        return limits

    def _publish(self, config_map: Manifest | None, on_change: QuotaListener) -> None:
        limits = self._parse((config_map or {}).get("data") or {})
        with self._lock:
            self._known = limits
            changed, self._published = limits != self._published, limits
        if changed:
            on_change(dict(limits))
