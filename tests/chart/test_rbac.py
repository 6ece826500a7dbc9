"""The operator's RBAC: exactly what it does, nothing more, in exactly the namespaces it
serves; and enough to hand the agents and the prefix index their Roles (Kubernetes'
escalation rule)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import kopf
import pytest

from kvpool.operator.admission.handlers import register as register_webhook
from kvpool.operator.admission.server import DEFAULT_CONFIGURATION, WebhookOptions
from kvpool.operator.apply import KINDS, kind_of
from kvpool.operator.handlers import registry
from kvpool.operator.reconcile import POOLS
from kvpool.operator.render import Children, Pool, render
from kvpool.operator.spec import GROUP, PLURAL, TENANT_PLURAL, PoolSpec

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

ADMISSION = "admissionregistration.k8s.io"
WEBHOOK_CONFIGURATIONS = ("mutatingwebhookconfigurations", "validatingwebhookconfigurations")
NamedPermission = tuple[str, str, str, str]
"""(API group, resource, verb, the object's name or "*" for any)."""
WEBHOOK: set[NamedPermission] = {
    (ADMISSION, resource, verb, name)
    for resource in WEBHOOK_CONFIGURATIONS
    for verb, name in (("create", "*"), ("patch", DEFAULT_CONFIGURATION))
}
"""kopf keeps its webhook configurations (a mutating one, and an empty validating one):
creates them if absent (create takes no resourceNames) and patches its own at each start."""


def _verbs(group: str, resource: str, *verbs: str) -> set[Permission]:
    return {(group, resource, verb) for verb in verbs}


CHILD_VERBS = ("get", "list", "watch", "create", "patch")
"""Server-side apply of a child (get, create, patch), watched for drift (list, watch)."""
RBAC = "rbac.authorization.k8s.io"
SECRET_VERBS: set[Permission] = _verbs("", "secrets", "get", "create", "patch", "delete")
"""Secrets: the tenant's Secret <name>-kvpool is made, then patched (its token rotated or
withdrawn), never deleted (the garbage collector takes it with its KVCacheTenant); a team's
own salt Secret is read; a pool's own Secrets are made and patched, and its peer Secret
kvpool-<pool>-peer (keys rotated) deleted when the pool turns spec.peers off. No list or
watch: the operator reads only the Secrets it names."""
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
    # the webhook's registrations (made only when it is on): its indices watch too
    webhook = _webhook_registry()
    indices = [handler.selector for handler in webhook._indexing.get_all_handlers()]
    assert {str(s.any_name) for s in indices if s is not None} == {PLURAL, TENANT_PLURAL}
    watched += indices
    for selector in watched:
        assert selector is not None and isinstance(selector.any_name, str), selector
        assert _verbs(str(selector.group), selector.any_name, "list", "watch") <= NAMESPACED


def _webhook_registry() -> kopf.OperatorRegistry:
    """A registry with the webhook's registrations alone (the process's stays untouched)."""
    webhook = kopf.OperatorRegistry()
    register_webhook(webhook, WebhookOptions(url_host="127.0.0.1"))
    return webhook


def test_the_webhook_asks_for_no_permission_but_its_configurations() -> None:
    """Its handler reads pods from the admission requests (no watch of pods), its indices
    what the operator watches already; kopf keeps the configuration the startup names."""
    webhook = _webhook_registry()
    for handlers in (webhook._watching, webhook._changing, webhook._spawning):
        assert not handlers.get_all_handlers()
    (mutate,) = webhook._webhooks.get_all_handlers()
    assert mutate.selector is not None and mutate.selector.any_name == "pods"
    assert mutate.operations == ["CREATE"]
    settings = kopf.OperatorSettings()
    (startup,) = webhook._activities.get_all_handlers()
    startup.fn(settings=settings)
    assert settings.admission.managed == DEFAULT_CONFIGURATION


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


@pytest.mark.process
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
        "Secrets: only those the operator names (the tenants', their salt Secrets, the pools' "
        "own), never listed"
    )


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.process
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


def _named_grants(manifests: list[Manifest]) -> set[NamedPermission]:
    """The operator's cluster-wide permissions, each with the object it is limited to."""
    subject = _subject(manifests)
    roles = {role["metadata"]["name"]: role["rules"] for role in by_kind(manifests, "ClusterRole")}
    granted: set[NamedPermission] = set()
    for binding in by_kind(manifests, "ClusterRoleBinding"):
        if subject in binding["subjects"]:
            for rule in roles[binding["roleRef"]["name"]]:
                granted |= {
                    (group, resource, verb, name)
                    for group in rule["apiGroups"]
                    for resource in rule["resources"]
                    for verb in rule["verbs"]
                    for name in rule.get("resourceNames", ["*"])
                }
    return granted


@pytest.mark.process
def test_the_webhook_adds_exactly_what_kopf_needs_to_keep_its_configurations(
    helm: Helm,
) -> None:
    """In a ClusterRole and binding of its own: the operator's other roles are the same
    with the webhook on or off, and off the chart renders none of it."""
    without = helm.template(sets=("csi.enabled=true",))
    manifests = helm.template("webhook.yaml")
    assert _named_grants(manifests) - _named_grants(without) == WEBHOOK
    assert _named_grants(without) <= _named_grants(manifests)
    (args,) = [
        c["args"] for c in one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"]
    ]
    assert "--webhook-configuration" not in args, "RBAC names the default configuration"
    own = [
        m
        for m in by_kind(manifests, "ClusterRole") + by_kind(manifests, "ClusterRoleBinding")
        if m["metadata"]["name"].endswith("-webhook")
    ]
    assert sorted(m["kind"] for m in own) == ["ClusterRole", "ClusterRoleBinding"]
    others = [m for m in by_kind(manifests, "ClusterRole") if m not in own]
    assert others == by_kind(without, "ClusterRole")
    for rendered in (without, helm.template("webhook.yaml", sets=("rbac.create=false",))):
        assert not [
            m
            for m in rendered
            if m["metadata"]["name"].endswith("-webhook") and m["kind"] != "Service"
        ]


@pytest.mark.process
@pytest.mark.parametrize("watched", [[], ["inference", "batch"]])
def test_the_csi_plugin_may_only_get_pools_and_services(helm: Helm, watched: list[str]) -> None:
    """A KVCachePool and its Service, read at each publish, in the
    namespaces the operator serves; the plugin's own account, not the operator's."""
    sets = tuple(f"operator.watchNamespaces[{i}]={name}" for i, name in enumerate(watched))
    manifests = helm.template("csi.yaml", sets=sets)
    (daemon_set,) = by_kind(manifests, "DaemonSet")
    account = daemon_set["spec"]["template"]["spec"]["serviceAccountName"]
    subject = {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    assert subject != _subject(manifests)
    roles = {role["metadata"]["name"]: role["rules"] for role in by_kind(manifests, "ClusterRole")}
    bindings = [
        binding
        for binding in by_kind(manifests, "ClusterRoleBinding") + by_kind(manifests, "RoleBinding")
        if subject in binding["subjects"]
    ]
    assert {binding["kind"] for binding in bindings} == (
        {"RoleBinding"} if watched else {"ClusterRoleBinding"}
    )
    if watched:
        assert {binding["metadata"]["namespace"] for binding in bindings} == set(watched)
    for binding in bindings:
        assert _granted(roles[binding["roleRef"]["name"]]) == (
            _verbs(GROUP, PLURAL, "get") | _verbs("", "services", "get")
        )
