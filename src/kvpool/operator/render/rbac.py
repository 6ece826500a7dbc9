"""The ServiceAccounts, Roles and RoleBindings of the agents (``kvpool-<pool>-agent``) and
of the index (``kvpool-<pool>-index``): each may read, and the agents patch, only what it
needs, in the pool's namespace only (Roles, never ClusterRoles)."""

from __future__ import annotations

from typing import Any

from kvpool.common.names import AGENT_COMPONENT, INDEX_COMPONENT
from kvpool.operator.render.objects import Manifest, Pool, manifest
from kvpool.operator.spec import PoolSpec


def account_with_role(
    pool: Pool, name: str, component: str, rules: list[dict[str, Any]]
) -> tuple[Manifest, Manifest, Manifest]:
    """A ServiceAccount ``name``, a Role ``name`` with ``rules``, and their RoleBinding."""
    rbac = "rbac.authorization.k8s.io"
    return (
        manifest("v1", "ServiceAccount", pool, name, component=component),
        manifest(f"{rbac}/v1", "Role", pool, name, component=component, rules=rules),
        manifest(
            f"{rbac}/v1",
            "RoleBinding",
            pool,
            name,
            component=component,
            roleRef={"apiGroup": rbac, "kind": "Role", "name": name},
            subjects=[{"kind": "ServiceAccount", "name": name, "namespace": pool.namespace}],
        ),
    )


POD_READER = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
"""Reading and watching the pods of the Role's namespace (the pool's agents, found by their
labels)."""


def agent_rbac(pool: Pool, spec: PoolSpec) -> tuple[Manifest, Manifest, Manifest]:
    """The agents may read, watch and patch their pool's quota ConfigMap, and read and
    watch its tenants ConfigMap (only the operator writes that one) and, with peers, the
    pods of its namespace (where the other agents are), nothing else."""
    quotas = {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": [pool.quotas_name],
        "verbs": ["get", "list", "watch", "patch"],
    }
    tenants = {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": [pool.tenants_name],
        "verbs": ["get", "list", "watch"],
    }
    peers = [POD_READER] if spec.peers.enabled else []
    return account_with_role(pool, pool.agent_name, AGENT_COMPONENT, [quotas, tenants, *peers])


def index_rbac(pool: Pool) -> tuple[Manifest, Manifest, Manifest]:
    """The index lists and watches the pods of its namespace: the pool's agents and, with
    spec.index.picker, the model server pods it picks from (an InferencePool selects pods of
    its own namespace, and its endpointPickerRef is a Service of that namespace: the
    pool's). Nothing more: no Secrets, no other namespace."""
    return account_with_role(pool, pool.index_name, INDEX_COMPONENT, [POD_READER])
