"""The operator's RBAC: exactly what it does, nothing more, in exactly the namespaces it
serves; and enough to hand the agents and the prefix index their Roles (Kubernetes'
escalation rule)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from kvpool_operator.apply import KINDS, kind_of
from kvpool_operator.handlers import registry
from kvpool_operator.reconcile import POOLS
from kvpool_operator.render import Children, Pool, render
from kvpool_operator.spec import GROUP, PLURAL, TENANT_PLURAL, PoolSpec

from .conftest import NAMESPACE, Helm, Manifest, by_kind, one

Permission = tuple[str, str, str]
"""(API group, resource, verb)."""

CLUSTER_WIDE: set[Permission] = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    ("", "namespaces", "get"),  # a tenant's namespace's labels (allowedNamespaces)
    ("", "namespaces", "list"),
    ("", "namespaces", "watch"),
}
"""kopf's needs whatever namespaces it serves, and the tenants' namespaces' labels."""


def _verbs(group: str, resource: str, *verbs: str) -> set[Permission]:
    return {(group, resource, verb) for verb in verbs}


CHILD_VERBS = ("get", "list", "watch", "create", "patch")
"""Server-side apply of a child (get, create, patch), watched for drift (list, watch)."""
RBAC = "rbac.authorization.k8s.io"
SECRET_VERBS: set[Permission] = _verbs("", "secrets", "get", "create", "patch")
"""Secrets: the tenant's Secret <name>-kvpool is made, then patched (its token rotated or
withdrawn), never deleted (the garbage collector takes it with its KVCacheTenant); a team's
own salt Secret is read. No list or watch: the operator reads only the Secrets it names."""
NAMESPACED: set[Permission] = (
    _verbs(GROUP, PLURAL, "get", "list", "watch", "patch")
    | _verbs(GROUP, f"{PLURAL}/status", "get", "patch")
    | _verbs(GROUP, f"{PLURAL}/finalizers", "update")
    # tenants: watched, kopf's bookkeeping and finalizer in their metadata, their status
    | _verbs(GROUP, TENANT_PLURAL, "get", "list", "watch", "patch")
    | _verbs(GROUP, f"{TENANT_PLURAL}/status", "patch")
    | SECRET_VERBS
    | _verbs("apps", "daemonsets", *CHILD_VERBS)
    # the index's children are deleted when a pool turns it off
    | _verbs("", "configmaps", *CHILD_VERBS, "delete")
    | _verbs("", "services", *CHILD_VERBS, "delete")
    | _verbs("", "serviceaccounts", *CHILD_VERBS, "delete")
    | _verbs("apps", "deployments", *CHILD_VERBS, "delete")
    | _verbs(RBAC, "roles", *CHILD_VERBS, "delete")
    | _verbs(RBAC, "rolebindings", *CHILD_VERBS, "delete")
    # a pool's NetworkPolicies are deleted when it turns spec.networkPolicy off
    | _verbs("networking.k8s.io", "networkpolicies", *CHILD_VERBS, "delete")
    | _verbs("monitoring.coreos.com", "servicemonitors", "get", "create", "patch", "delete")
    | _verbs("", "events", "create", "patch")
    # the agents' addresses (a tenant's usage and clearing); granted on to the index's Role
    | _verbs("", "pods", "get", "list", "watch")
)
"""What the operator does in a namespace it serves (the tests below derive it from the code)."""

EVERYTHING = {
    "tenants": {"tokensSecretRef": {"name": "tokens"}},
    "index": {"enabled": True},
    "metrics": {"serviceMonitor": {"enabled": True}},
    "networkPolicy": {
        "enabled": True,
        "clients": [{"podSelector": {}}],
        "gateways": [{"podSelector": {}}],
    },
}
"""A pool with every optional child."""


def _render(spec: dict[str, Any]) -> Children:
    return render(Pool("main", "inference", "uid"), PoolSpec.parse(spec), default_image="x")


def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0]


def test_the_expected_permissions_follow_the_operators_code() -> None:
    """Every kind the operator writes and every resource kopf watches is in NAMESPACED."""
    deleted = {(ref.api_version, ref.kind) for ref in _render({}).absent}
    assert {kind for _, kind in deleted} >= {"Deployment", "ServiceMonitor", "NetworkPolicy"}
    for kind in KINDS.values():
        group = _group(kind.api_version)
        if kind is POOLS:
            continue  # kopf patches pools; the operator writes their status subresource
        needed = {"get", "create", "patch"}
        needed |= {"delete"} if (kind.api_version, kind.kind) in deleted else set()
        assert _verbs(group, kind.plural, *needed) <= NAMESPACED, kind
    watched = [handler.selector for handler in registry._watching.get_all_handlers()]
    watched += [handler.selector for handler in registry._changing.get_all_handlers()]
    assert watched, "kopf's registry moved: find the operator's watched resources again"
    for selector in watched:
        assert selector is not None and isinstance(selector.any_name, str), selector
        assert _verbs(str(selector.group), selector.any_name, "list", "watch") <= NAMESPACED


def test_every_permission_has_a_use() -> None:
    """NAMESPACED names no resource the operator neither writes nor hands on in a Role."""
    children = _render(EVERYTHING)
    assert children.index is not None
    written = {(_group(m["apiVersion"]), kind_of(m).plural) for m in children.present()}
    handed_on = {
        (group, resource)
        for role in (children.role, children.index.role)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    pools = {(GROUP, PLURAL), (GROUP, f"{PLURAL}/status"), (GROUP, f"{PLURAL}/finalizers")}
    tenants = {(GROUP, TENANT_PLURAL), (GROUP, f"{TENANT_PLURAL}/status"), ("", "secrets")}
    events = {("", "events")}
    resources = {(group, resource) for group, resource, _ in NAMESPACED}
    assert resources == written | handed_on | pools | tenants | events


def _subject(manifests: list[Manifest]) -> dict[str, str]:
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
    return {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": NAMESPACE}


def _granted(rules: Iterable[dict[str, Any]]) -> set[Permission]:
    granted: set[Permission] = set()
    for rule in rules:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule, rule
        granted |= {
            (group, resource, verb)
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for verb in rule["verbs"]
        }
    return granted


def _grants(manifests: list[Manifest], namespace: str | None) -> set[Permission]:
    """The operator's permissions in ``namespace`` (None: cluster-scoped ones)."""
    subject = _subject(manifests)
    roles = {
        (role["kind"], role["metadata"]["name"]): role["rules"]
        for role in by_kind(manifests, "ClusterRole")
    }
    granted: set[Permission] = set()
    bindings = by_kind(manifests, "ClusterRoleBinding") + [
        binding
        for binding in by_kind(manifests, "RoleBinding")
        if binding["metadata"]["namespace"] == namespace
    ]
    for binding in bindings:
        if subject in binding["subjects"]:
            ref = binding["roleRef"]
            granted |= _granted(roles[ref["kind"], ref["name"]])
    return granted


@pytest.mark.parametrize("watched", [[], ["inference", "batch"]])
def test_the_operator_gets_exactly_what_it_needs_where_it_works(
    helm: Helm, watched: list[str]
) -> None:
    sets = tuple(f"operator.watchNamespaces[{i}]={name}" for i, name in enumerate(watched))
    manifests = helm.template(sets=sets)
    for namespace in watched or ["inference", "anywhere"]:
        assert _grants(manifests, namespace) == NAMESPACED | CLUSTER_WIDE, namespace
    if watched:
        assert _grants(manifests, "elsewhere") == CLUSTER_WIDE
        assert {
            binding["metadata"]["namespace"] for binding in by_kind(manifests, "RoleBinding")
        } == set(watched)
    for role in by_kind(manifests, "ClusterRole"):
        for verb, resource in (
            (v, r) for rule in role["rules"] for v in rule["verbs"] for r in rule["resources"]
        ):
            assert "*" not in (verb, resource)
            assert verb not in {"escalate", "bind", "impersonate"}
    held = _grants(manifests, (watched or ["inference"])[0])
    assert {p for p in held if p[1] == "secrets"} == SECRET_VERBS, (
        "Secrets: only the tenants' (made and patched, never listed) and their salt Secrets "
        "(read); the pools' Secrets are mounted by the agents, never read by the operator"
    )


def test_tenant_teams_may_edit_their_kvcachetenants_through_edit_and_admin(helm: Helm) -> None:
    """Aggregated into the built-in edit and admin roles (as cert-manager does); the
    status is the operator's; Secrets are covered by edit itself."""
    (role,) = [
        role
        for role in by_kind(helm.template(), "ClusterRole")
        if role["metadata"]["name"].endswith("-tenant-edit")
    ]
    labels = role["metadata"]["labels"]
    assert labels["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert labels["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    verbs = ("get", "list", "watch", "create", "update", "patch", "delete")
    assert _granted(role["rules"]) == _verbs(GROUP, TENANT_PLURAL, *verbs)
    bound = {b["roleRef"]["name"] for b in by_kind(helm.template(), "ClusterRoleBinding")}
    assert role["metadata"]["name"] not in bound


def test_the_operator_may_hand_the_agents_and_the_index_their_roles(helm: Helm) -> None:
    """Kubernetes lets a subject create a Role only with permissions it holds itself."""
    children = _render(EVERYTHING)
    assert children.index is not None
    held = _grants(helm.template(), "inference")
    for role in (children.role, children.index.role):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert (group, resource, verb) in held, role["metadata"]["name"]
    assert _verbs("", "pods", "get", "list", "watch") <= held
    assert _verbs("apps", "deployments", "get", "list", "watch", "create", "patch", "delete") <= (
        held
    )


def test_without_rbac_the_chart_makes_none(helm: Helm) -> None:
    manifests = helm.template(sets=("rbac.create=false", "serviceAccount.create=false"))
    kinds = {manifest["kind"] for manifest in manifests}
    assert not kinds & {
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ServiceAccount",
    }
