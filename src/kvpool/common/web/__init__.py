"""HTTP plumbing shared by the agent's API and the prefix index's: the server with its
connection bounds, the body gate, bearer authentication, health routes and error bodies.

- :mod:`~kvpool.common.web.serving`: uvicorn with bounded connections and read timeouts;
- :mod:`~kvpool.common.web.connections`: the connection gate itself (connections, which
  it closes unauthenticated first; request heads' time, size and fields; unread responses'
  time; TCP_NODELAY) and its counts of refusals;
- :mod:`~kvpool.common.web.body_gate`: body size and token checked before a body is read;
- :mod:`~kvpool.common.web.common`: bearer auth, health routes, error bodies;
- :mod:`~kvpool.common.web.refusal_metrics`: what the server refused, as a counter;
- :mod:`~kvpool.common.web.rate_limited_log`: log lines that a flood cannot multiply.
"""
