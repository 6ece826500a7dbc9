"""Render a pool's children: pure functions from a pool and its spec to manifests.

The children (shared/ARCHITECTURE.md), all in the pool's namespace, all labelled with
the pool and owned by it (:mod:`.objects`: a controller ownerReference, so deleting the pool
deletes them):

- ``kvpool-<pool>-config``: ConfigMap, key ``agent.yaml``: the agent's own
  :class:`~kvpool.common.config.AgentConfig`, validated by that model and dumped from it
  (:mod:`.config`);
- ``kvpool-<pool>-quotas``: ConfigMap of tenant quotas; the operator renders only its
  metadata, the agents own its data;
- ``kvpool-<pool>-tenants``: ConfigMap of the KVCacheTenants' token digests and quota
  ceilings; the operator renders only its metadata and writes its data key by key
  (``tenants.py``), the agents watch it;
- ``kvpool-<pool>-agent``: ServiceAccount, Role and RoleBinding that let the agents read,
  watch and patch that one quota ConfigMap, read and watch the tenants ConfigMap and, with
  peers (``spec.peers``), read and watch the pods of the namespace (:mod:`.rbac`);
- ``kvpool-<pool>-agent``: DaemonSet of agents, rolled by a checksum of ``agent.yaml``
  (:mod:`.daemonset`, with :mod:`.pods` for what its pods share with the index's); with
  peers, its pods serve the port ``peer`` and mount the pool's peer Secret
  ``kvpool-<pool>-peer``, which the operator mints and rotates (``kvpool.operator.peers``,
  not a rendered child: its keys are random);
- ``kvpool-<pool>``: Service (``internalTrafficPolicy: Local``) whose annotations tell
  the vLLM connector how to reach and use its node's agent (:mod:`.services`);
- ``kvpool-<pool>``: ServiceMonitor, when the spec asks for one (:mod:`.services`);
- ``kvpool-<pool>-agent`` and, with the index, ``kvpool-<pool>-index``: NetworkPolicies,
  when the spec asks for them (``spec.networkPolicy.enabled``), that isolate the agent pods
  and the index pods for ingress and admit each peer the spec names to the ports it needs;
  applied before the other children, so that no pod of the pool runs unprotected
  (:mod:`.network`);
- the prefix index, when the spec asks for it (``spec.index.enabled``), labelled
  ``app.kubernetes.io/component: index`` (so the agents' Service and DaemonSet never select
  its pods, nor the index's discovery, which follows ``component: agent`` pods):
  ``kvpool-<pool>-index-config``: ConfigMap, key ``index.yaml``: the index's own
  :class:`~kvpool.common.index_config.IndexConfig`; ``kvpool-<pool>-index``: ServiceAccount,
  Role and RoleBinding that let it read and watch the pool's pods, a Deployment of
  ``spec.index.replicas`` independent indexes, and a ClusterIP Service for gateways
  (:mod:`.index`); with ``spec.index.picker.disaggregation`` its pods mount the pool's
  disaggregation key Secret ``kvpool-<pool>-pd-key``, which the operator makes
  (``kvpool.operator.disagg_key``, not a rendered child: its key is random).

The NetworkPolicies, the ServiceMonitor and the index are optional children:
:class:`Children` lists those the spec asks for next to the required ones, and names
(:attr:`Children.absent`) those it does not, which the operator deletes where the pool owns
them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.common.names import AGENT_CONFIG_KEY
from kvpool.operator.render.config import agent_config, index_config, settings_file
from kvpool.operator.render.daemonset import agent_memory, daemonset, format_bytes
from kvpool.operator.render.index import (
    PICKER_PORT_NAME,
    IndexChildren,
    index_children,
    index_refs,
)
from kvpool.operator.render.network import network_policies, network_policy_refs
from kvpool.operator.render.objects import ChildRef, Manifest, Pool, manifest
from kvpool.operator.render.pods import AGENT_UID
from kvpool.operator.render.rbac import agent_rbac
from kvpool.operator.render.services import agent_service, service_monitor, service_monitor_refs
from kvpool.operator.spec import PoolSpec

__all__ = [
    "AGENT_UID",
    "PICKER_PORT_NAME",
    "ChildRef",
    "Children",
    "IndexChildren",
    "Manifest",
    "Pool",
    "agent_config",
    "agent_memory",
    "format_bytes",
    "index_config",
    "index_refs",
    "network_policy_refs",
    "render",
    "service_monitor_refs",
]


@dataclass(frozen=True)
class Children:
    """Every child of one pool: those it has, and the optional ones it must not have."""

    service_account: Manifest
    role: Manifest
    role_binding: Manifest
    config: Manifest
    quotas: Manifest
    tenants: Manifest
    service: Manifest
    daemonset: Manifest
    index: IndexChildren | None
    service_monitor: Manifest | None
    network_policies: tuple[Manifest, ...]
    absent: tuple[ChildRef, ...]
    """Optional children the spec does not ask for, in the order they are deleted."""

    def required(self) -> list[Manifest]:
        """The children every pool has, in the order they are applied (the DaemonSet last)."""
        return [
            self.service_account,
            self.role,
            self.role_binding,
            self.config,
            self.quotas,
            self.tenants,
            self.service,
            self.daemonset,
        ]

    def optional(self) -> list[Manifest]:
        """The index's children and the ServiceMonitor, where the spec asks for them, in the
        order they are applied (after the required children)."""
        index = self.index.manifests() if self.index is not None else []
        return index + ([self.service_monitor] if self.service_monitor is not None else [])

    def present(self) -> list[Manifest]:
        """Every child the pool has, in the order they are applied (NetworkPolicies first)."""
        return [*self.network_policies, *self.required(), *self.optional()]


def render(pool: Pool, spec: PoolSpec, *, default_image: str) -> Children:
    """Every child of ``pool``; :class:`InvalidSpec` if the agent or the index would refuse
    its configuration."""
    config = agent_config(pool, spec)
    config_text = settings_file(config)
    service_account, role, role_binding = agent_rbac(pool, spec)
    index = index_children(pool, spec, default_image) if spec.index.enabled else None
    monitor = service_monitor(pool, spec) if spec.metrics.service_monitor.enabled else None
    policies = network_policies(pool, spec) if spec.network_policy.enabled else ()
    made = {ChildRef.of(policy) for policy in policies}
    return Children(
        service_account=service_account,
        role=role,
        role_binding=role_binding,
        config=manifest(
            "v1", "ConfigMap", pool, pool.config_name, data={AGENT_CONFIG_KEY: config_text}
        ),
        quotas=manifest("v1", "ConfigMap", pool, pool.quotas_name),
        tenants=manifest("v1", "ConfigMap", pool, pool.tenants_name),
        service=agent_service(pool, spec, config),
        daemonset=daemonset(pool, spec, config, config_text, default_image),
        index=index,
        service_monitor=monitor,
        network_policies=policies,
        absent=(() if index else index_refs(pool))
        + (() if monitor else service_monitor_refs(pool))
        + tuple(ref for ref in network_policy_refs(pool) if ref not in made),
    )
