"""The agent's edges: each decodes a request, calls the service and encodes the answer.

- :mod:`~kvpool_agent.edge.zmq_server`: the data plane (ZMQ ROUTER; sessions, leases);
- :mod:`~kvpool_agent.edge.http_api`: the control API (FastAPI; quotas, usage, clearing);
- :mod:`~kvpool_agent.edge.events`: the chunk events feed (ZMQ PUB) for the prefix index;
- :mod:`~kvpool_agent.edge.metrics`: the Prometheus collector.
"""
