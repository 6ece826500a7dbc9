"""The pool-wide prefix index: which node holds which prompt prefix, for cache-aware routing.

Every agent publishes the chunks entering and leaving its L1 (``kvpool_agent.edge.events``);
the index follows them all and answers gateways: the nodes ranked by the cached
prefix of a prompt, and where to send it within a load bound.

Core (no sockets, no web framework, no metrics library):

* :mod:`~kvpool_agent.index.tracker`: ``key → {node: last seen}`` with per-node caps
  and the verified binary search for the longest prefix per node;
* :mod:`~kvpool_agent.index.query`: a prompt's keys (hashed lazily) and matches;
* :mod:`~kvpool_agent.index.policy`: the routing policy and its defaults;
* :mod:`~kvpool_agent.index.service`: lookup and route, timed (the in-process API).

Edges: :mod:`~kvpool_agent.index.subscriber` (ZMQ: events, gaps, resync by snapshot),
:mod:`~kvpool_agent.kube.discovery` (static list, Kubernetes pods),
:mod:`~kvpool_agent.index.http_api` (FastAPI; gateway and admin tokens of the pool's
tokens file, :mod:`kvpool_agent.tenancy.auth`), :mod:`~kvpool_agent.index.metrics` (Prometheus),
:mod:`~kvpool_agent.index.client` (HTTP client for gateways),
:mod:`~kvpool_agent.index.config` and :mod:`~kvpool_agent.index.server` (the
``kvpool index`` process).
"""
