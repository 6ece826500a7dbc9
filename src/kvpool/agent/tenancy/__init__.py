"""Who may do what, and how much each tenant may keep.

- :mod:`~kvpool.common.auth`: bearer tokens (admin, tenant, gateway) by digest;
- :mod:`~kvpool.agent.tenancy.quota_store`: durable quotas in a file (the embedded default);
- :mod:`~kvpool.agent.tenancy.kube_quota_store`: the pool's quota ConfigMap, shared by
  every agent of the pool;
- :mod:`~kvpool.agent.tenancy.tenants_watch`: the KVCacheTenants' tokens and ceilings,
  followed from the pool's tenants ConfigMap.
"""
