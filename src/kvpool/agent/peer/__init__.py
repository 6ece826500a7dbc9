"""Peers: the pool's other agents as a tier between NVMe and S3, and this agent serving them.

:mod:`~kvpool.agent.peer.wire` (frames), :mod:`~kvpool.common.handshake` and
:mod:`~kvpool.agent.peer.session` (both sides prove the pool's peer credential),
:mod:`~kvpool.agent.peer.transport` (the interface, and TCP),
:mod:`~kvpool.agent.peer.serving` (the serving half),
:mod:`~kvpool.agent.peer.links` and :mod:`~kvpool.agent.peer.adapter` (the asking half),
:mod:`~kvpool.agent.peer.directory` (who the peers are), :mod:`~kvpool.agent.peer.node`
(the parts, from the configuration).
"""
