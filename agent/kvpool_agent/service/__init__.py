"""The service seam: the one way every edge (ZMQ, HTTP, metrics) and every L2 controller
reaches the L1 cache.

- :mod:`~kvpool_agent.service.cache_service`: :class:`CacheService`, the operations under
  one lock;
- :mod:`~kvpool_agent.service.results`: the plain values its operations answer;
- :mod:`~kvpool_agent.service.hooks`: the protocols the parts attached at composition
  implement (write-back, prefetch, L2 drops, the events publisher).
"""
