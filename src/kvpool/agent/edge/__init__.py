"""The agent's edges: each decodes a request, calls the service and encodes the answer.

- :mod:`~kvpool.agent.edge.zmq_server`: the data plane (ZMQ requests, leases): its loop,
  its handlers in :mod:`~kvpool.agent.edge.zmq_handlers`, its sessions in
  :mod:`~kvpool.agent.edge.zmq_sessions`;
- :mod:`~kvpool.agent.edge.zmtp`: its port, ZMTP framed with bounded messages (a ROUTER's part);
- :mod:`~kvpool.agent.edge.http_api`: the control API (FastAPI; quotas, usage, clearing);
- :mod:`~kvpool.agent.edge.door`: the door (a Unix socket) that hands out chunk files;
- :mod:`~kvpool.agent.edge.events`: the chunk events feed (ZMQ PUB) for the prefix index;
- :mod:`~kvpool.agent.edge.metrics`: the Prometheus collector.
"""
