"""The cache core: the L1 index over the shared segment, and nothing that talks to the world.

- :mod:`~kvpool.agent.core.l1`: :class:`L1Cache`, the index, chunk life cycle, leases,
  eviction and tenant records;
- :mod:`~kvpool.agent.core.allocator`: page extents of the segment;
- :mod:`~kvpool.agent.core.journal`: the segment's chunk table, for warm restarts;
- :mod:`~kvpool.agent.core.cache_types`: the cache's values and domain errors;
- :mod:`~kvpool.agent.core.quota_book`: the quotas in force per tenant;
- :mod:`~kvpool.agent.core.policies`: eviction orders within a tenant (LRU, ARC);
- :mod:`~kvpool.agent.core.factory`: the L1 tier built from the configuration.

It imports no transport, web, metrics, Kubernetes or S3 library (``make lint``).
"""
