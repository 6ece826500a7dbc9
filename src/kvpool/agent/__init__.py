"""The node agent (``kvpool-agent``, ``pip install 'kvpool[agent]'``): one per GPU node.

Public surface: :func:`kvpool.agent.main.main` (the process: arguments, configuration
errors, exit codes) and :mod:`kvpool.agent.server` (its composition root). Everything else
is the agent's own, in layers, each importing only the ones listed after it:

* ``main`` -- ``kvpool-agent``; ``server`` -- builds every part, starts and stops them;
* ``edge`` -- the ZMQ server, the door, the HTTP API, chunk events, metrics;
* ``peer`` -- the pool's other agents: a tier, and serving them;
* ``tiering`` -- write-back to and prefetch from L2, tier costs;
* ``l2`` -- the NVMe and S3 tiers, the sealed object codec;
* ``service`` -- the one seam through which every edge and controller reaches the cache;
* ``tenancy`` -- quota stores, the KVCacheTenants' tokens and ceilings;
* ``core`` -- the L1 cache over the shared segment (no I/O library at all).
"""
