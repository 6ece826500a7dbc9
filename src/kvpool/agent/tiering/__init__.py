"""Controllers that move chunks between L1 and the L2 tiers, over the cache service.

:mod:`~kvpool.agent.tiering.writeback` copies committed (or reused) chunks down
to the tiers; :mod:`~kvpool.agent.tiering.prefetch` loads a missed prefix back
up into L1. The tiers themselves (NVMe, S3: adapters that know nothing of the
cache) live in :mod:`kvpool.agent.l2`.
"""
