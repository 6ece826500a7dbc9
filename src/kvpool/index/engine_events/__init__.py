"""The GPU tier: each vLLM server's own prefix cache, learned from vLLM's KV events.

:mod:`.wire` decodes vLLM's messages, :mod:`.chains` turns one server's block chains into
kvpool chunk keys (the design is in its docstring), :mod:`.follower` follows every server
in one thread and writes a :class:`~kvpool.index.tracker.PrefixTracker` whose nodes are
the servers' addresses, so the picker asks it ``longest_prefixes(prompt_keys, servers)``
as it asks the L1 tracker; :mod:`.metrics` exports the follower's numbers.
"""

from kvpool.index.engine_events.follower import (
    EngineEvents,
    EngineStatus,
    EventEndpoint,
    event_endpoints,
)
from kvpool.index.engine_events.metrics import EngineEventsCollector

__all__ = [
    "EngineEvents",
    "EngineEventsCollector",
    "EngineStatus",
    "EventEndpoint",
    "event_endpoints",
]
