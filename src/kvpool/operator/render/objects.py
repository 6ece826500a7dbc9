"""What every child of a pool is: named after the pool, labelled with it and owned by it (a
controller ownerReference, so deleting the pool deletes it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.common import names
from kvpool.common.names import (
    AGENT_COMPONENT,
    APP,
    COMPONENT_LABEL,
    INSTANCE_LABEL,
    MANAGED_BY_LABEL,
    NAME_LABEL,
    OPERATOR,
    POOL_LABEL,
)
from kvpool.operator.spec import API_VERSION, KIND

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Pool:
    """The identity of a KVCachePool: what its children are named after and owned by."""

    name: str
    namespace: str
    uid: str

    @property
    def config_name(self) -> str:
        return names.config_map_name(self.name)

    @property
    def quotas_name(self) -> str:
        return names.quotas_name(self.name)

    @property
    def tenants_name(self) -> str:
        return names.tenants_name(self.name)

    @property
    def agent_name(self) -> str:
        return names.agent_name(self.name)

    @property
    def service_name(self) -> str:
        return names.service_name(self.name)

    @property
    def index_name(self) -> str:
        return names.index_name(self.name)

    @property
    def index_access_name(self) -> str:
        return names.index_access_name(self.name)

    @property
    def index_config_name(self) -> str:
        return names.index_config_map_name(self.name)

    @property
    def spaces_name(self) -> str:
        """The Secret of the salts of the pool's shared spaces (the operator's alone)."""
        return f"kvpool-{self.name}-spaces"

    @property
    def peer_name(self) -> str:
        """The Secret of the pool's peer credential (``spec.peers``): the operator mints and
        rotates its keys, the agents mount it."""
        return f"kvpool-{self.name}-peer"

    @property
    def pd_key_name(self) -> str:
        """The Secret of the pool's disaggregation key (``spec.index.picker.disaggregation``):
        the operator makes it, the index signs with it, the decode pods' sidecars verify."""
        return f"kvpool-{self.name}-pd-key"

    def labels(self, component: str = AGENT_COMPONENT) -> dict[str, str]:
        return {
            NAME_LABEL: APP,
            INSTANCE_LABEL: self.name,
            COMPONENT_LABEL: component,
            POOL_LABEL: self.name,
        }

    def selector(self, component: str = AGENT_COMPONENT) -> dict[str, str]:
        """The labels that a component's workload and Service select its pods on."""
        labels = self.labels(component)
        return {key: labels[key] for key in (NAME_LABEL, INSTANCE_LABEL, COMPONENT_LABEL)}


@dataclass(frozen=True)
class ChildRef:
    """Which object a child is: enough to get or delete it in the pool's namespace."""

    api_version: str
    kind: str
    name: str

    @classmethod
    def of(cls, manifest: Mapping[str, Any]) -> ChildRef:
        return cls(manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"])


def manifest(
    api_version: str,
    kind: str,
    pool: Pool,
    name: str,
    *,
    component: str = AGENT_COMPONENT,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    **body: Any,
) -> Manifest:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": pool.namespace,
        "labels": {
            **pool.labels(component),
            MANAGED_BY_LABEL: OPERATOR,
            **(labels or {}),
        },
        "ownerReferences": [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": pool.name,
                "uid": pool.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, **body}
