"""Peers: the pool's other agents as a tier between NVMe and S3, and this agent serving them.

:mod:`~kvpool_agent.peer.wire` (frames), :mod:`~kvpool_agent.peer.handshake` and
:mod:`~kvpool_agent.peer.session` (both sides prove the pool's peer credential),
:mod:`~kvpool_agent.peer.transport` (the interface, and TCP),
:mod:`~kvpool_agent.peer.serving` (the serving half),
:mod:`~kvpool_agent.peer.links` and :mod:`~kvpool_agent.peer.adapter` (the asking half),
:mod:`~kvpool_agent.peer.directory` (who the peers are), :mod:`~kvpool_agent.peer.node`
(the parts, from the configuration).
"""
