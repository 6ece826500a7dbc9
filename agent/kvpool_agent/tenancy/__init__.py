"""Who may do what, and how much each tenant may keep.

- :mod:`~kvpool_agent.tenancy.auth`: bearer tokens (admin, tenant, gateway) by digest;
- :mod:`~kvpool_agent.tenancy.quota_store`: durable quotas in a file (the embedded default);
- :mod:`~kvpool_agent.tenancy.kube_quota_store`: the pool's quota ConfigMap, shared by
  every agent of the pool;
- :mod:`~kvpool_agent.tenancy.tenants_watch`: the KVCacheTenants' tokens and ceilings,
  followed from the pool's tenants ConfigMap.
"""
