"""What a pool's ConfigMaps say of a shared space, from the pool's spec and the tenants it has
accepted: pure functions of those.

- the tenants ConfigMap, key ``space.<space tenant id>``: a
  :class:`~kvpool.common.tenants_configmap.SpaceEntry` whose members are the accepted
  KVCacheTenants (their entries in the same ConfigMap) in the space's allowedNamespaces,
  whose owners are those among them in its owners, with its pinBudget;
- the quotas ConfigMap, key ``<space tenant id>``: the space's quota.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvpool.common.keys import tenant_id
from kvpool.common.quotas import TierLimits, quota_to_configmap
from kvpool.common.tenants_configmap import SpaceEntry, TenantEntry
from kvpool.operator.render import Pool
from kvpool.operator.spec import SharedSpaceSpec


@dataclass(frozen=True)
class Space:
    """A declared space and its salt."""

    spec: SharedSpaceSpec
    salt: str

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def tenant_id(self) -> str:
        """What the agents keep the space's chunks under."""
        return tenant_id(self.salt)

    def members(self, tenants: Mapping[str, TenantEntry]) -> dict[str, str]:
        """The accepted tenants the space admits: tenant id -> ``namespace/name``."""
        return {
            tenant: entry.source
            for tenant, entry in tenants.items()
            if _namespace(entry.source) in self.spec.allowed_namespaces
        }

    def entry(self, pool: Pool, tenants: Mapping[str, TenantEntry]) -> SpaceEntry:
        members = self.members(tenants)
        owners = {
            tenant for tenant, source in members.items() if _namespace(source) in self.spec.owners
        }
        source = f"{pool.namespace}/{pool.name}/{self.name}"
        return SpaceEntry(source, frozenset(members), frozenset(owners), self.spec.pin_budget)

    def quota(self) -> str:
        """The value of the space's key in the quotas ConfigMap."""
        quota = self.spec.quota
        return quota_to_configmap(TierLimits(quota.l1, quota.nvme_bytes))


def revoked(entry: SpaceEntry) -> SpaceEntry:
    """A removed space's entry until its chunks are cleared: no member, no owner, no pin."""
    return SpaceEntry(entry.source)


def space_name(entry: SpaceEntry) -> str:
    """The space's name, from its entry's ``namespace/pool/name``."""
    return entry.source.rpartition("/")[2]


def _namespace(source: str) -> str:
    return source.partition("/")[0]
