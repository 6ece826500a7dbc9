"""The pool's tenants ConfigMap: token digests and quota ceilings of its KVCacheTenants.

The operator writes the ConfigMap (``kvpool-<pool>-tenants``), one key per tenant with
JSON merge patches; the agents only read it, with a list and a watch. Its ``data``:

- ``<tenant id>``: ``{"tokens": ["<sha256 hex>", ...], "ceiling": {"l1": <bytes or null>,
  "nvme": <bytes or null>}, "tenant": "<namespace>/<name>"}``: the tenant's bearer tokens
  (digests only) and the most it may set as its own quota per tier (null: no ceiling);
- ``operator``: ``{"tokens": ["<sha256 hex>"]}``: the operator's admin token.

:class:`TenantsWatch` parses each version of the ConfigMap into a complete
:class:`TenantsSnapshot` and hands it to its listeners (the token authority, the quota
ceilings): a key that is gone is gone from the next snapshot, so removing a tenant's key
revokes its tokens within a watch event's latency. A malformed entry is logged by key and
reason, never by value (a value holds token digests), and skipped; the rest apply.
A deleted or absent ConfigMap is an empty snapshot.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kubernetes.config import ConfigException

from kvpool_agent.auth import ADMIN, Grant, Principal, is_tenant_id
from kvpool_agent.kube_watch import ListWatch, Manifest, connect_config_map, watch_config_map
from kvpool_agent.quotas import TierLimits, as_limits, quota_from_json

log = logging.getLogger(__name__)

OPERATOR_KEY = "operator"
_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class TenantEntry:
    tokens: tuple[bytes, ...]
    """SHA-256 digests of the tenant's bearer tokens."""
    ceiling: TierLimits
    """The most the tenant may set as its own quota, per tier (None: no ceiling)."""
    source: str
    """The KVCacheTenant that made the entry (``namespace/name``), for logs."""


@dataclass(frozen=True, slots=True)
class TenantsSnapshot:
    tenants: dict[str, TenantEntry] = field(default_factory=dict)
    operator_tokens: tuple[bytes, ...] = ()

    def grants(self) -> list[Grant]:
        """Every token digest with its principal: the operator's as admin, each tenant's own."""
        grants: list[Grant] = [(digest, ADMIN) for digest in self.operator_tokens]
        for tenant, entry in self.tenants.items():
            principal = Principal.for_tenant(tenant)
            grants.extend((digest, principal) for digest in entry.tokens)
        return grants

    def ceilings(self) -> dict[str, TierLimits]:
        return {tenant: entry.ceiling for tenant, entry in self.tenants.items()}


SnapshotListener = Callable[[TenantsSnapshot], None]


class TenantsWatchError(RuntimeError):
    """The tenants ConfigMap cannot be followed (no access to the Kubernetes API)."""


def parse_tenants(data: Mapping[str, str], where: str) -> TenantsSnapshot:
    """The snapshot of a ConfigMap's ``data``; malformed entries are logged and skipped."""
    snapshot = TenantsSnapshot()
    for key, value in data.items():
        try:
            if key == OPERATOR_KEY:
                snapshot = TenantsSnapshot(snapshot.tenants, _parse_operator(value))
            elif is_tenant_id(key):
                snapshot.tenants[key] = _parse_tenant(value)
            else:
                raise ValueError("the key is neither a tenant id nor 'operator'")
        except ValueError as error:
            log.error("%s: entry %s skipped: %s", where, _key_glimpse(key), error)
    return snapshot


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


def _parse_operator(value: str) -> tuple[bytes, ...]:
    entry = _object(value, {"tokens"})
    return _digests(entry.get("tokens"))


def _parse_tenant(value: str) -> TenantEntry:
    entry = _object(value, {"tokens", "ceiling", "tenant"})
    source = entry.get("tenant", "")
    if not isinstance(source, str):
        raise ValueError("'tenant' is not a string")
    try:
        ceiling = as_limits(quota_from_json(entry.get("ceiling")))
    except ValueError as error:
        raise ValueError(f"'ceiling': {error}") from None
    return TenantEntry(_digests(entry.get("tokens")), ceiling, source)


def _object(value: str, keys: set[str]) -> dict[str, object]:
    try:
        entry = json.loads(value)
    except ValueError:
        raise ValueError("not JSON") from None  # the decoder's message quotes the value
    if not isinstance(entry, dict):
        raise ValueError(f"expected a JSON object, got {type(entry).__name__}")
    unknown = set(entry) - keys
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}; expected {sorted(keys)}")
    return entry


def _digests(value: object) -> tuple[bytes, ...]:
    if not isinstance(value, list):
        raise ValueError("'tokens' must be a list of SHA-256 hex digests")
    for position, item in enumerate(value, start=1):
        if not isinstance(item, str) or not _DIGEST.fullmatch(item):
            raise ValueError(f"token #{position} is not a SHA-256 digest (64 lowercase hex)")
    return tuple(bytes.fromhex(item) for item in value)


def _key_glimpse(key: str) -> str:
    """A key, quoted only when it has the shape of a key (tenant id, 'operator')."""
    if key == OPERATOR_KEY or is_tenant_id(key):
        return key
    return f"{key[:2]!r}... ({len(key)} characters)"
