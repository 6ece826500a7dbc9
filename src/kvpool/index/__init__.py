"""The pool-wide prefix index and endpoint picker: which node holds which prompt prefix, for
cache-aware routing.

Every agent publishes the chunks entering and leaving its L1 (``kvpool.agent.edge.events``);
the index follows them all and answers gateways: the nodes ranked by the cached
prefix of a prompt, and where to send it within a load bound. Public surface: the
``kvpool-index`` command, its settings and HTTP API, and :mod:`~kvpool.index.client` for
gateways.

Core (no sockets, no web framework, no metrics library):

* :mod:`~kvpool.index.tracker`: ``key → {node: last seen}`` with per-node caps
  and the verified binary search for the longest prefix per node;
* :mod:`~kvpool.index.query`: a prompt's keys (hashed lazily) and matches;
* :mod:`~kvpool.common.routing`: the routing policy and its defaults;
* :mod:`~kvpool.index.service`: lookup and route, timed (the in-process API).

The endpoint picker (with ``picker.enabled``; :mod:`~kvpool.index.endpoint_picker`
starts its parts): :mod:`~kvpool.index.picking` (its request and answer),
:mod:`~kvpool.index.picker` (the estimate over the tiers and the servers' loads, and
whether to disaggregate prefill from decode),
:mod:`~kvpool.index.model_servers` (the candidates and their vLLM metrics),
:mod:`~kvpool.index.engine_events` (each server's GPU prefix cache from its vLLM KV
events), :mod:`~kvpool.index.prompts` (text to token ids), :mod:`~kvpool.index.epp`
(Envoy's ext_proc over gRPC), :mod:`~kvpool.index.placements` and
:mod:`~kvpool.index.placement_events` (what each server can load from kvpool, as vLLM KV
events).

Edges: :mod:`~kvpool.index.subscriber` (ZMQ: events, gaps, resync by snapshot),
:mod:`~kvpool.common.kube.discovery` (static list, Kubernetes pods),
:mod:`~kvpool.index.http_api` (FastAPI; gateway and admin tokens of the pool's
tokens file, :mod:`kvpool.common.auth`), :mod:`~kvpool.index.metrics` (Prometheus),
:mod:`~kvpool.index.client` (HTTP client for gateways),
:mod:`~kvpool.common.index_config` and :mod:`~kvpool.index.server` (the
``kvpool-index`` process).
"""
