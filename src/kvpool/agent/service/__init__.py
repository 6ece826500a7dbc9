"""The service seam: the one way every edge (ZMQ, HTTP, metrics) and every L2 controller
reaches the L1 cache.

- :mod:`~kvpool.agent.service.cache_service`: :class:`CacheService`, the one composition of
  the facades the edges use, over one cache and one lock:
  :mod:`~kvpool.agent.service.data_service` (lookups, stores, leases),
  :mod:`~kvpool.agent.service.pin_service` (pins, warms, shared spaces),
  :mod:`~kvpool.agent.service.quota_service` (quotas) and
  :mod:`~kvpool.agent.service.report_service` (usage, counters), each over
  :mod:`~kvpool.agent.service.state`;
- :mod:`~kvpool.agent.service.landing`: a chunk from L2 received into its reserved pages;
- :mod:`~kvpool.agent.service.results`: the plain values its operations answer;
- :mod:`~kvpool.agent.service.hooks`: the protocols the parts attached at composition
  implement (write-back, prefetch, L2 drops, the events publisher).
"""
